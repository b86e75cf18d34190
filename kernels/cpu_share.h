// Work of one op call shared between the calling thread and one helper thread, for decode steps on a CPU whose
// other cores may be busy (kernels/cpu_share.cpp; used by the qgemv op, kernels/cpu_qgemv.cpp).
//
// Why not torch's intra-op pool: at::parallel_for splits work statically, so an op ends when its slowest thread
// does; beside a process that holds a core, the thread that shares it is descheduled for whole time slices and every
// op of a step waits for it (runtime/model/threads.py). Here the caller never waits for a helper that is not
// running:
// - The units (weight rows) are cut into blocks of about a microsecond of work. The caller takes its blocks from the
//   front; the helper, when it comes, steals the back half of what is left, and each thread that runs out steals the
//   back half of the other's (work stealing). Each thread reads long ascending runs, and a caller whose helper never
//   comes reads the weights front to back, as alone (blocks taken in turn from one shared counter made SmolLM2's
//   int8 head 0.68x of one thread: the hardware prefetcher starts over at every block).
// - The caller, once no block is left to take, waits for each block the helper still computes about twice as long
//   as it takes per block itself, then computes it again ("takes it over"; after one, the rest at once); the
//   helper's late values are dropped. A descheduled helper costs the caller that wait and a block per call.
// - The helper writes only into the job's own buffer, which it keeps alive: the caller's output is never touched by
//   the helper, so a helper that wakes up after the call returned changes nothing.
// - The helper runs under SCHED_IDLE: it gets a core only when no other thread of the machine wants it, so the
//   frontend processes and other programs keep their cores. After 8 calls in a row it added nothing to (another
//   process holds the other core), the caller stops handing it calls, then tries 8 again every 64 calls: each
//   hand-off to a sleeping helper wakes it, and waking it for nothing cost a decode step 15% beside a busy core.
// - It spins between jobs for about 200 us (a decode step's ops follow each other within tens of microseconds), then
//   sleeps on a futex until the next job; the caller's side takes no lock (a SCHED_IDLE thread preempted while
//   holding one would stall the caller).
// Each unit's values are computed by the same code whoever runs it: the result is identical with the helper on or off.
#pragma once

#include <cstdint>
#include <functional>

namespace radixserve {

// `units` units of work (rows), claimed block_units at a time; compute(begin, end, dst) writes units begin .. end - 1's
// values, unit_floats each, into dst. compute must only read data that stays alive while the closure does (it is
// copied into the job: capture tensors and shared_ptrs by value).
struct ShareWork {
    int64_t units;
    int64_t block_units;
    int64_t unit_floats;
    std::function<void(int64_t, int64_t, float*)> compute;
};

// Runs every block of work once, on the calling thread and the helper (when on and there is more than one block),
// and calls store(begin, end, values) on the calling thread for each block, values its (end - begin) * unit_floats
// floats. Blocks only while it waits (about twice a block's time at most) for a block the helper is computing.
void share_work(ShareWork work, const std::function<void(int64_t, int64_t, const float*)>& store);

// Turns the helper thread on (started on first use) or off (share_work then runs every block on the caller).
void set_helper(bool on);

// Whether the helper is on.
bool helper_on();

}  // namespace radixserve
