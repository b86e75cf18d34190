// The helper thread that shares an op's blocks with its caller (the protocol: kernels/cpu_share.h).
#include "cpu_share.h"

#include <pthread.h>
#include <sched.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace radixserve {
namespace {

using Clock = std::chrono::steady_clock;

// How long the helper spins for the next job before it sleeps: longer than the gaps between a decode step's GEMVs
// (an attention of tens of microseconds), shorter than the wait between steps (the scheduler's turn).
constexpr auto SPIN = std::chrono::microseconds(200);
// The least the caller waits for a block the helper is computing before it takes it over.
constexpr auto LEAST_WAIT = std::chrono::microseconds(2);

// A block's state, for the blocks the helper claims: FREE until it marks it (BY_HELPER), DONE when its values are
// in the job's buffer, TAKEN when the caller took it over (the helper's late values are dropped).
enum BlockState : int { FREE, BY_HELPER, DONE, TAKEN };

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}

// The blocks of a piece not claimed yet, front .. back - 1, in one word (front in the low 32 bits), so that its owner
// (from the front) and a thief (from the back) each claim a block with one compare-and-swap. On a cache line of its
// own: the two pieces' owners claim on different cores.
struct alignas(64) Deque {
    std::atomic<uint64_t> ends{0};

    static uint64_t pack(int64_t front, int64_t back) {
        return static_cast<uint64_t>(back) << 32 | static_cast<uint64_t>(front);
    }

    // The block taken from the front (from_back false) or the back, -1 when the piece has none left.
    int64_t take(bool from_back) {
        uint64_t e = ends.load(std::memory_order_acquire);
        for (;;) {
            const int64_t front = static_cast<int64_t>(e & 0xFFFFFFFFu);
            const int64_t back = static_cast<int64_t>(e >> 32);
            if (front >= back)
                return -1;
            const uint64_t want = from_back ? pack(front, back - 1) : pack(front + 1, back);
            if (ends.compare_exchange_weak(e, want, std::memory_order_acq_rel))
                return from_back ? back - 1 : front;
        }
    }
};

struct Job {
    explicit Job(ShareWork w)
        : work(std::move(w)),
          blocks((work.units + work.block_units - 1) / work.block_units),
          deques(new Deque[PIECES]),
          state(new std::atomic<int>[blocks]),
          result(work.units * work.unit_floats) {
        for (int64_t p = 0; p < PIECES; ++p)
            deques[p].ends.store(Deque::pack(blocks * p / PIECES, blocks * (p + 1) / PIECES), std::memory_order_relaxed);
        for (int64_t b = 0; b < blocks; ++b)
            state[b].store(FREE, std::memory_order_relaxed);
    }

    int64_t begin(int64_t block) const {
        return block * work.block_units;
    }

    int64_t end(int64_t block) const {
        return std::min(work.units, (block + 1) * work.block_units);
    }

    // Block b's values into dst (the job's buffer or the caller's).
    void compute(int64_t block, float* dst) const {
        work.compute(begin(block), end(block), dst);
    }

    float* result_of(int64_t block) {
        return result.data() + begin(block) * work.unit_floats;
    }

    static constexpr int64_t PIECES = 2;  // the caller's and the helper's
    ShareWork work;
    int64_t blocks;
    std::unique_ptr<Deque[]> deques;
    std::unique_ptr<std::atomic<int>[]> state;
    std::vector<float> result;  // the helper's blocks' values, unit u's at u * unit_floats
    // the next piece to claim, on a cache line of its own (both threads write it)
    alignas(64) std::atomic<int64_t> next{0};
    char pad[64 - sizeof(std::atomic<int64_t>)];
};

// Where a thread is in a job: the piece it owns (-1: none yet); once no piece is left it steals from the pieces'
// backs.
struct Cursor {
    int64_t piece = -1;
    bool pieces_left = true;
};

// The thread's next block: the front of the piece it owns, then of the next unclaimed piece, then the back of any
// piece; -1 when every block is claimed.
int64_t next_block(Job& job, Cursor& cur) {
    while (cur.pieces_left) {
        if (cur.piece >= 0) {
            const int64_t b = job.deques[cur.piece].take(false);
            if (b >= 0)
                return b;
        }
        cur.piece = job.next.fetch_add(1, std::memory_order_relaxed);
        cur.pieces_left = cur.piece < Job::PIECES;
    }
    for (int64_t p = Job::PIECES - 1; p >= 0; --p) {
        const int64_t b = job.deques[p].take(true);
        if (b >= 0)
            return b;
    }
    return -1;
}

// The helper's side: claim blocks until none is left, each into the job's buffer.
void help(Job& job) {
    Cursor cur;
    for (int64_t b = next_block(job, cur); b >= 0; b = next_block(job, cur)) {
        int expected = FREE;
        if (!job.state[b].compare_exchange_strong(expected, BY_HELPER, std::memory_order_acq_rel))
            continue;  // the caller took it over before the helper marked it
        job.compute(b, job.result_of(b));
        expected = BY_HELPER;
        job.state[b].compare_exchange_strong(expected, DONE, std::memory_order_acq_rel);
    }
}

class Helper {
   public:
    // Hands the helper a job (starting its thread on first use).
    void post(std::shared_ptr<Job> job) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!started_) {
            std::thread([this] { loop(); }).detach();
            started_ = true;
        }
        job_ = std::move(job);
        seq_.fetch_add(1, std::memory_order_release);
        if (sleeping_)
            cv_.notify_one();
    }

    // Drops the helper's reference to a finished job (it keeps its own while it computes a chunk).
    void finish(const std::shared_ptr<Job>& job) {
        std::lock_guard<std::mutex> lock(mu_);
        if (job_ == job)
            job_.reset();
    }

   private:
    void loop() {
        sched_param param{};
        pthread_setschedparam(pthread_self(), SCHED_IDLE, &param);  // runs only on a core nothing else wants
        uint64_t seen = 0;
        for (;;) {
            wait_for(seen);
            std::shared_ptr<Job> job;
            {
                std::lock_guard<std::mutex> lock(mu_);
                job = job_;
                seen = seq_.load(std::memory_order_acquire);
            }
            if (job)
                help(*job);
        }
    }

    // Returns when a job newer than `seen` was posted: spins for SPIN, then sleeps.
    void wait_for(uint64_t seen) {
        const auto deadline = Clock::now() + SPIN;
        for (int spins = 1; seq_.load(std::memory_order_acquire) == seen; ++spins) {
            pause();
            if (spins % 64 == 0 && Clock::now() > deadline) {
                std::unique_lock<std::mutex> lock(mu_);
                sleeping_ = true;
                cv_.wait(lock, [&] { return seq_.load(std::memory_order_acquire) != seen; });
                sleeping_ = false;
                return;
            }
        }
    }

    std::mutex mu_;
    std::condition_variable cv_;
    std::shared_ptr<Job> job_;
    std::atomic<uint64_t> seq_{0};
    bool sleeping_ = false;
    bool started_ = false;
};

// The process's helper: never destroyed (its thread may outlive static destruction at exit); a forked child gets a
// new one (the parent's thread does not exist there, and its mutex may have been held at the fork).
std::atomic<Helper*> g_helper{nullptr};
std::atomic<bool> g_on{false};
std::once_flag g_atfork;

void new_helper_in_child() {
    g_helper.store(new Helper(), std::memory_order_release);
}

Helper& helper() {
    std::call_once(g_atfork, [] {
        g_helper.store(new Helper(), std::memory_order_release);
        pthread_atfork(nullptr, nullptr, new_helper_in_child);
    });
    return *g_helper.load(std::memory_order_acquire);
}

// The caller's side for a block the helper claimed: wait up to `patience` for its values, then take it over.
void collect(Job& job, int64_t b, Clock::duration patience, std::vector<float>& buf,
             const std::function<void(int64_t, int64_t, const float*)>& store) {
    const auto deadline = Clock::now() + patience;
    for (;;) {
        int state = job.state[b].load(std::memory_order_acquire);
        if (state == DONE) {
            store(job.begin(b), job.end(b), job.result_of(b));
            return;
        }
        if (Clock::now() > deadline && job.state[b].compare_exchange_strong(state, TAKEN, std::memory_order_acq_rel)) {
            job.compute(b, buf.data());
            store(job.begin(b), job.end(b), buf.data());
            return;
        }
        pause();
    }
}

}  // namespace

void share_work(ShareWork work, const std::function<void(int64_t, int64_t, const float*)>& store) {
    std::vector<float> buf(work.block_units * work.unit_floats);
    if (!helper_on() || work.units <= work.block_units) {
        for (int64_t begin = 0; begin < work.units; begin += work.block_units) {
            const int64_t end = std::min(work.units, begin + work.block_units);
            work.compute(begin, end, buf.data());
            store(begin, end, buf.data());
        }
        return;
    }
    auto job = std::make_shared<Job>(std::move(work));
    Helper& h = helper();
    h.post(job);
    std::vector<char> mine(job->blocks, 0);
    int64_t own = 0;
    Cursor cur;
    const auto start = Clock::now();
    for (int64_t b = next_block(*job, cur); b >= 0; b = next_block(*job, cur)) {
        job->compute(b, buf.data());
        store(job->begin(b), job->end(b), buf.data());
        mine[b] = 1;
        ++own;
    }
    const auto per_block = own ? (Clock::now() - start) / own : Clock::duration(LEAST_WAIT);
    const auto patience = std::max<Clock::duration>(LEAST_WAIT, 2 * per_block);
    for (int64_t b = 0; b < job->blocks; ++b)
        if (!mine[b])
            collect(*job, b, patience, buf, store);
    h.finish(job);
}

void set_helper(bool on) {
    g_on.store(on, std::memory_order_relaxed);
}

bool helper_on() {
    return g_on.load(std::memory_order_relaxed);
}

}  // namespace radixserve
