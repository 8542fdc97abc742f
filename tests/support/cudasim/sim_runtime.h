// The fiber scheduler behind sim.h; included once at the end of each generated module.
// A fiber switch saves the callee-saved registers on the old stack and swaps stack
// pointers (x86-64 System V): ucontext's switch costs a system call, ~20x slower.
#include <stdio.h>
#include <stdlib.h>

#include <random>
#include <vector>

#if !defined(__x86_64__)
#error "cudasim's fiber switch is written for x86-64"
#endif

extern "C" void cudasim_switch(void** save_sp, void* next_sp);
asm(R"(
    .text
    .globl cudasim_switch
    .hidden cudasim_switch
cudasim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");

namespace sim {
dim3 thread_idx, block_idx, block_dim, grid_dim;

namespace {
constexpr size_t STACK = 64 * 1024;
struct Barrier {
    unsigned count = 0, gen = 0;
};
struct Fiber {
    void* sp;
    dim3 tid;
    int lane, warp, parity;
    bool done;
    const unsigned* wait_gen;  // blocked until *wait_gen != wait_val
    unsigned wait_val;
};
std::vector<Fiber> fibers;
std::vector<char> stacks;
std::vector<Barrier> warp_bars;
constexpr int SLOT = 8;          // uint64s a lane may put in one exchange (an mma's fragments)
std::vector<uint64_t> exchange;  // [2 parities][warps][32 lanes][SLOT]
std::vector<unsigned char> dynamic_smem;
Barrier block_bar;
void* scheduler_sp;
Fiber* cur;
const std::function<void()>* kernel;
int live, nthreads, nwarps;
bool direct, cooperative;  // running threads as plain calls / the first block met a barrier
char error[512];
struct DirectBarrier {};  // thrown when a plain call meets a barrier

int warp_lanes(int w) { return std::min(32, nthreads - 32 * w); }

void to_scheduler() { cudasim_switch(&cur->sp, scheduler_sp); }

void block_on(Barrier& b, int expected) {
    if (direct) throw DirectBarrier();
    cooperative = true;
    unsigned gen = b.gen;
    if (++b.count == (unsigned)expected) {
        b.count = 0;
        b.gen++;
        return;
    }
    cur->wait_gen = &b.gen;
    cur->wait_val = gen;
    to_scheduler();
}

void fiber_main() {  // entered by cudasim_switch's ret; never returns
    (*kernel)();
    cur->done = true;
    to_scheduler();
}

// Thread k of a block in run order (alternate blocks run backwards), as threadIdx.
dim3 thread_of(int k, dim3 block, bool reverse) {
    unsigned i = reverse ? block.x * block.y * block.z - 1 - k : k;
    return {i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
}

// A fresh stack whose first switch pops six zero registers and returns into fiber_main,
// with the stack aligned as at a function's entry.
void* fresh_stack(int i) {
    auto top = reinterpret_cast<uintptr_t>(&stacks[(size_t)(i + 1) * STACK]) & ~uintptr_t(15);
    auto* sp = reinterpret_cast<void**>(top - 64);
    for (int r = 0; r < 6; r++) sp[r] = nullptr;
    sp[6] = reinterpret_cast<void*>(&fiber_main);
    return sp;
}

// cp.async's copies, per thread of the block: those no commit closed yet, then the
// committed groups, oldest first.
struct Copy {
    void* dst;
    const void* src;
    int bytes, src_bytes;
};
struct AsyncCopies {
    std::vector<Copy> open;
    std::vector<std::vector<Copy>> groups;
};
std::vector<AsyncCopies> async_copies;

AsyncCopies& my_copies() {
    return async_copies[thread_idx.x + block_dim.x * (thread_idx.y + block_dim.y * thread_idx.z)];
}
}  // namespace

// The copy lands at the wait covering its group; until then its destination holds 0xff
// bytes (NaN in fp32 and bf16), written at issue: on the GPU the bytes may land any time in
// between, so a read before the wait (a missing wait) and a read of a buffer a prefetch
// is overwriting (a missing barrier before the prefetch) both give NaN here, not stale
// bytes that happen to be right.
void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    memset(dst, 0xff, bytes);
    my_copies().open.push_back({dst, src, bytes, src_bytes});
}

void cp_async_commit() {
    AsyncCopies& a = my_copies();
    a.groups.push_back(std::move(a.open));
    a.open.clear();
}

// Makes the oldest groups' copies until at most `pending` groups are left.
void cp_async_wait(int pending) {
    AsyncCopies& a = my_copies();
    size_t done = a.groups.size() > (size_t)pending ? a.groups.size() - pending : 0;
    for (size_t g = 0; g < done; g++)
        for (const Copy& c : a.groups[g]) {
            memcpy(c.dst, c.src, c.src_bytes);
            memset((char*)c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);
        }
    a.groups.erase(a.groups.begin(), a.groups.begin() + done);
}

void syncthreads() { block_on(block_bar, live); }

unsigned char* dynamic_shared() { return dynamic_smem.data(); }
unsigned dynamic_shared_bytes() { return (unsigned)dynamic_smem.size(); }

void fail(const char* what) {
    snprintf(error, sizeof error, "%s in block (%u,%u,%u) thread %u", what, block_idx.x,
             block_idx.y, block_idx.z, thread_idx.x);
    if (direct) throw DirectBarrier();
    to_scheduler();  // the scheduler sees the error and abandons the block
    __builtin_unreachable();
}

void trap() { fail("__trap()"); }

// Every lane of the warp must arrive (all 32, or all the warp has): the mask says which.
void check_whole_warp(unsigned mask, const char* what) {
    int n = warp_lanes(cur->warp);
    if (mask != (n == 32 ? 0xffffffffu : (1u << n) - 1)) {
        snprintf(error, sizeof error, "%s with mask %#x and %d lanes in the warp", what, mask,
                 n);
        to_scheduler();
    }
}

void syncwarp(unsigned mask) {
    if (direct) throw DirectBarrier();
    check_whole_warp(mask, "__syncwarp");
    block_on(warp_bars[cur->warp], warp_lanes(cur->warp));
}

void warp_exchange(const void* in, void* out, int lane_xor, unsigned mask, int bytes) {
    if (direct) throw DirectBarrier();  // no fiber is current: say so before reading one
    Fiber& f = *cur;
    int n = warp_lanes(f.warp), src = f.lane ^ lane_xor;
    if (mask != (n == 32 ? 0xffffffffu : (1u << n) - 1) || src >= n) {
        snprintf(error, sizeof error, "shuffle mask %#x / lane %d with %d lanes in the warp",
                 mask, src, n);
        to_scheduler();  // the scheduler sees the error and abandons the block
    }
    uint64_t* buf = &exchange[(size_t)(f.parity * nwarps + f.warp) * 32 * SLOT];
    memcpy(&buf[f.lane * SLOT], in, bytes);
    block_on(warp_bars[f.warp], n);
    memcpy(out, &buf[src * SLOT], bytes);
    f.parity ^= 1;  // the next shuffle uses the other buffer: no second barrier needed
}

// all[l] = lane l's in, for all 32 lanes (a warp-wide instruction: the whole warp takes part).
void warp_gather(const void* in, void* all, int bytes, const char* what) {
    if (direct) throw DirectBarrier();
    Fiber& f = *cur;
    if (warp_lanes(f.warp) != 32 || bytes > SLOT * 8) {
        snprintf(error, sizeof error, "%s in a warp of %d threads", what, warp_lanes(f.warp));
        to_scheduler();
    }
    uint64_t* buf = &exchange[(size_t)(f.parity * nwarps + f.warp) * 32 * SLOT];
    memcpy(&buf[f.lane * SLOT], in, bytes);
    block_on(warp_bars[f.warp], 32);
    for (int l = 0; l < 32; l++) memcpy((char*)all + (size_t)l * bytes, &buf[l * SLOT], bytes);
    f.parity ^= 1;
}

// One block as fibers; alternate blocks run their threads in reverse order.
const char* run_fibers(dim3 block, bool reverse) {
    for (int i = 0; i < nthreads; i++) {
        Fiber& f = fibers[i];
        f.sp = fresh_stack(i);
        f.tid = thread_of(i, block, false);
        f.lane = i % 32;
        f.warp = i / 32;
        f.parity = 0;
        f.done = false;
        f.wait_gen = nullptr;
    }
    block_bar = Barrier();
    warp_bars.assign(nwarps, Barrier());
    live = nthreads;
    while (live > 0) {
        bool ran = false;
        for (int k = 0; k < nthreads; k++) {
            Fiber& f = fibers[reverse ? nthreads - 1 - k : k];
            if (f.done || (f.wait_gen && *f.wait_gen == f.wait_val)) continue;
            f.wait_gen = nullptr;
            cur = &f;
            thread_idx = f.tid;
            cudasim_switch(&scheduler_sp, f.sp);
            ran = true;
            if (error[0]) return error;
            if (f.done && --live > 0 && block_bar.count == (unsigned)live) {
                block_bar.count = 0;  // exited threads count as arrived
                block_bar.gen++;
            }
        }
        if (!ran) {
            snprintf(error, sizeof error,
                     "block (%u,%u,%u): %d threads wait at a barrier that cannot complete (a "
                     "shuffle with exited lanes, or __syncthreads in divergent code)",
                     block_idx.x, block_idx.y, block_idx.z, live);
            return error;
        }
    }
    return nullptr;
}

// The order blocks run in: the grid's (x fastest), or under CUDASIM_ORDER=random (as the
// streams, cupy.py) a fresh random permutation per launch, since a GPU promises none
// (CUDASIM_SEED fixes it). An empty vector: the grid's own order.
std::vector<long long> block_order(long long n) {
    static const char *order_env = getenv("CUDASIM_ORDER"), *seed = getenv("CUDASIM_SEED");
    static const bool shuffle = order_env && !strcmp(order_env, "random");
    static std::mt19937_64 rng(seed ? strtoull(seed, nullptr, 10) : std::random_device{}());
    std::vector<long long> order;
    if (!shuffle) return order;
    order.resize(n);
    for (long long i = 0; i < n; i++) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    return order;
}

// Blocks run one after another (block_order). The first to run goes as fibers; if it met
// no barrier, the kernel has none, and the other blocks' threads run as plain calls (much
// faster).
const char* launch(dim3 grid, dim3 block, unsigned shared_bytes,
                   const std::function<void()>& body) {
    nthreads = block.x * block.y * block.z;
    nwarps = (nthreads + 31) / 32;
    if (fibers.size() < (size_t)nthreads) {
        fibers.resize(nthreads);
        stacks.resize(nthreads * STACK);
    }
    exchange.assign(2 * nwarps * 32 * SLOT, 0);
    dynamic_smem.assign(shared_bytes, 0xff);  // uninitialized, as on the GPU: NaN-like bytes
    kernel = &body;
    grid_dim = grid;
    block_dim = block;
    error[0] = 0;
    direct = cooperative = false;
    long long blocks = (long long)grid.x * grid.y * grid.z;
    std::vector<long long> order = block_order(blocks);
    for (long long nblock = 0; nblock < blocks; nblock++) {
        long long b = order.empty() ? nblock : order[nblock];
        unsigned bx = b % grid.x, by = b / grid.x % grid.y, bz = b / grid.x / grid.y;
        block_idx = {bx, by, bz};
        async_copies.assign(nthreads, AsyncCopies());  // a block's copies end with it
        bool reverse = nblock & 1;
        if (nblock == 0 || cooperative) {
            if (run_fibers(block, reverse)) return error;
            direct = !cooperative;
            continue;
        }
        try {
            for (int k = 0; k < nthreads; k++) {
                thread_idx = thread_of(k, block, reverse);
                body();
            }
        } catch (DirectBarrier&) {
            if (!error[0])
                snprintf(error, sizeof error, "block (%u,%u,%u) met a barrier that "
                         "the first block did not; cudasim cannot run this kernel", bx, by, bz);
            return error;
        }
    }
    return nullptr;
}
}  // namespace sim
