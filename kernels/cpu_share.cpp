// The helper thread that shares an op's blocks with its caller (the protocol: kernels/cpu_share.h).
#include "cpu_share.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
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
// After MISSES_TO_PAUSE calls in a row to which the helper added no block (it got no core: another process holds
// it), a caller stops handing it calls, then every PROBE_EVERY calls tries MISSES_TO_PAUSE calls again (a probe of one
// call never recovered: the sleeping helper woke after that call had ended). Every hand-off to a sleeping helper
// wakes it, and a woken SCHED_IDLE thread that finds no idle core still takes the caller's core now and then: beside
// a busy core, handing it every call made SmolLM2's in-process decode step 0.85x of the helper off.
constexpr int MISSES_TO_PAUSE = 8;
constexpr int PROBE_EVERY = 64;
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

// The blocks a thread owns and has not started, front .. back - 1, in one word (front in the low 32 bits): the
// owner takes them one by one from the front, the other thread steals the back half of what is left, each with one
// compare-and-swap. On a cache line of its own: the caller's and the helper's are written on different cores.
struct alignas(64) Deque {
    std::atomic<uint64_t> ends{0};

    static uint64_t pack(int64_t front, int64_t back) {
        return static_cast<uint64_t>(back) << 32 | static_cast<uint64_t>(front);
    }

    // The owner's next block, -1 when none is left.
    int64_t pop() {
        uint64_t e = ends.load(std::memory_order_acquire);
        for (;;) {
            const int64_t front = static_cast<int64_t>(e & 0xFFFFFFFFu);
            const int64_t back = static_cast<int64_t>(e >> 32);
            if (front >= back)
                return -1;
            if (ends.compare_exchange_weak(e, pack(front + 1, back), std::memory_order_acq_rel))
                return front;
        }
    }

    // Takes the back half (at least one block) of what is left as first .. last - 1; false when nothing is left.
    bool steal(int64_t* first, int64_t* last) {
        uint64_t e = ends.load(std::memory_order_acquire);
        for (;;) {
            const int64_t front = static_cast<int64_t>(e & 0xFFFFFFFFu);
            const int64_t back = static_cast<int64_t>(e >> 32);
            if (front >= back)
                return false;
            const int64_t keep = (back - front) / 2;
            if (ends.compare_exchange_weak(e, pack(front, front + keep), std::memory_order_acq_rel)) {
                *first = front + keep;
                *last = back;
                return true;
            }
        }
    }

    // The owner's new blocks first .. last - 1, once its own are all taken.
    void refill(int64_t first, int64_t last) {
        ends.store(pack(first, last), std::memory_order_release);
    }
};

enum Side : int { CALLER, HELPER };

struct Job {
    explicit Job(ShareWork w)
        : work(std::move(w)),
          blocks((work.units + work.block_units - 1) / work.block_units),
          state(new std::atomic<int>[blocks]),
          result(new float[work.units * work.unit_floats]) {  // not zeroed: every block the caller reads is written
        deques[CALLER].refill(0, blocks);  // the helper starts by stealing the back half
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
        return result.get() + begin(block) * work.unit_floats;
    }

    ShareWork work;
    int64_t blocks;
    std::unique_ptr<std::atomic<int>[]> state;
    std::unique_ptr<float[]> result;  // the helper's blocks' values, unit u's at u * unit_floats
    Deque deques[2];  // by Side
};

// The next block of the thread on `side`: the front of its own blocks, refilled by stealing the back half of the
// other's when they run out; -1 when both are empty. Blocks are read in ascending order within each run, so the
// hardware prefetcher follows (a caller whose helper never runs reads the weights front to back, as alone).
int64_t next_block(Job& job, Side side) {
    for (;;) {
        const int64_t b = job.deques[side].pop();
        if (b >= 0)
            return b;
        int64_t first = 0;
        int64_t last = 0;
        if (!job.deques[1 - side].steal(&first, &last))
            return -1;
        job.deques[side].refill(first, last);
    }
}

// The helper's side: its blocks, each into the job's buffer, until none is left.
void help(Job& job) {
    for (int64_t b = next_block(job, HELPER); b >= 0; b = next_block(job, HELPER)) {
        int expected = FREE;
        if (!job.state[b].compare_exchange_strong(expected, BY_HELPER, std::memory_order_acq_rel))
            continue;  // the caller took it over before the helper marked it
        job.compute(b, job.result_of(b));
        expected = BY_HELPER;
        job.state[b].compare_exchange_strong(expected, DONE, std::memory_order_acq_rel);
    }
}

// Linux futex wait / wake on a 32-bit word (the helper's sleep without a lock: a SCHED_IDLE thread preempted while
// holding a mutex would stall the caller that needs it).
void futex_wait(std::atomic<uint32_t>* word, uint32_t seen) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}

// The helper thread and its mailbox. Lock-free on the caller's side: a job goes into the slot as a heap-allocated
// shared_ptr that whoever exchanges it out owns (the helper, or the caller replacing or clearing an untaken one).
class Helper {
   public:
    // Hands the helper a job (starting its thread on first use), waking it if it sleeps.
    void post(const std::shared_ptr<Job>& job) {
        std::call_once(started_, [this] { std::thread([this] { loop(); }).detach(); });
        delete slot_.exchange(new std::shared_ptr<Job>(job), std::memory_order_acq_rel);
        epoch_.fetch_add(1, std::memory_order_seq_cst);
        if (sleeping_.load(std::memory_order_seq_cst))
            futex_wake(&epoch_);
    }

    // Takes back a job the helper has not taken (it keeps its own reference while it computes a block).
    void finish() {
        delete slot_.exchange(nullptr, std::memory_order_acq_rel);
    }

   private:
    void loop() {
        sched_param param{};
        pthread_setschedparam(pthread_self(), SCHED_IDLE, &param);  // runs only on a core nothing else wants
        for (;;) {
            std::shared_ptr<Job>* box = take();
            const std::shared_ptr<Job> job = std::move(*box);
            delete box;
            help(*job);
        }
    }

    // The next job: spins for SPIN, then sleeps until one is posted.
    std::shared_ptr<Job>* take() {
        auto deadline = Clock::now() + SPIN;
        for (int spins = 1;; ++spins) {
            if (slot_.load(std::memory_order_relaxed) != nullptr)
                if (std::shared_ptr<Job>* box = slot_.exchange(nullptr, std::memory_order_acq_rel))
                    return box;
            pause();
            if (spins % 64 == 0 && Clock::now() > deadline) {
                sleep();
                deadline = Clock::now() + SPIN;
            }
        }
    }

    // Sleeps unless a job is in the slot; a post after the check changes epoch_, so the wait returns at once.
    void sleep() {
        sleeping_.store(true, std::memory_order_seq_cst);
        const uint32_t seen = epoch_.load(std::memory_order_seq_cst);
        if (slot_.load(std::memory_order_seq_cst) == nullptr)
            futex_wait(&epoch_, seen);
        sleeping_.store(false, std::memory_order_relaxed);
    }

    std::once_flag started_;
    std::atomic<std::shared_ptr<Job>*> slot_{nullptr};
    std::atomic<uint32_t> epoch_{0};
    std::atomic<bool> sleeping_{false};
};

// The process's helper: never destroyed (its thread may outlive static destruction at exit); a forked child gets a
// new one, not started (the parent's thread does not exist there).
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

// The caller thread's record of the helper: calls in a row it added no block to, calls skipped since the last probe,
// blocks it computed in the current call.
thread_local int t_misses = 0;
thread_local int t_skipped = 0;
thread_local int64_t t_helped = 0;

// Whether this call is handed to the helper (MISSES_TO_PAUSE, PROBE_EVERY).
bool should_post() {
    if (t_misses < MISSES_TO_PAUSE)
        return true;
    if (++t_skipped < PROBE_EVERY)
        return false;
    t_skipped = 0;
    t_misses = 0;  // a probe: the next MISSES_TO_PAUSE calls
    return true;
}

// The caller's side for a block the helper took: wait until `deadline` for its values, then take it over. Returns
// whether it took it over.
bool collect(Job& job, int64_t b, Clock::time_point deadline, std::vector<float>& buf,
             const std::function<void(int64_t, int64_t, const float*)>& store) {
    for (;;) {
        int state = job.state[b].load(std::memory_order_acquire);
        if (state == DONE) {
            store(job.begin(b), job.end(b), job.result_of(b));
            ++t_helped;
            return false;
        }
        if (Clock::now() > deadline && job.state[b].compare_exchange_strong(state, TAKEN, std::memory_order_acq_rel)) {
            job.compute(b, buf.data());
            store(job.begin(b), job.end(b), buf.data());
            return true;
        }
        pause();
    }
}

}  // namespace

void share_work(ShareWork work, const std::function<void(int64_t, int64_t, const float*)>& store) {
    std::vector<float> buf(work.block_units * work.unit_floats);
    if (!helper_on() || work.units <= work.block_units || !should_post()) {
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
    const auto start = Clock::now();
    for (int64_t b = next_block(*job, CALLER); b >= 0; b = next_block(*job, CALLER)) {
        job->compute(b, buf.data());
        store(job->begin(b), job->end(b), buf.data());
        mine[b] = 1;
        ++own;
    }
    // Left: the blocks the helper took (the one it computes, any it stole and has not started). Once one is taken
    // over, the helper is not running: the rest are taken over at once.
    const auto per_block = own ? (Clock::now() - start) / own : Clock::duration(LEAST_WAIT);
    const auto patience = std::max<Clock::duration>(LEAST_WAIT, 2 * per_block);
    bool stalled = false;
    t_helped = 0;
    for (int64_t b = 0; b < job->blocks; ++b)
        if (!mine[b])
            stalled = collect(*job, b, stalled ? Clock::now() : Clock::now() + patience, buf, store) || stalled;
    t_misses = t_helped ? 0 : t_misses + 1;
    h.finish();
}

void set_helper(bool on) {
    g_on.store(on, std::memory_order_relaxed);
}

bool helper_on() {
    return g_on.load(std::memory_order_relaxed);
}

}  // namespace radixserve
