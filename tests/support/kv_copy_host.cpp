// connector/kernels/kv_copy.cu compiled for the host, for the CPU tests (tests/connector/test_kv_copy_kernel.py).
//
// A shim gives the kernel's source what CUDA would: the qualifiers (empty), the vector word types
// (structs that count the words they move, so a test can tell which width a copy used), the
// thread and block indices (globals), and min(). run() executes a launch: every thread block of
// the grid, every thread of the block, one after another. The kernel's threads share nothing and
// write disjoint bytes, so running them in turn gives the bytes the device gives.
#include <cstddef>

#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict

struct dim3 { unsigned int x, y, z; };
static dim3 threadIdx, blockIdx, blockDim, gridDim;
static unsigned long long moved[17];  // bytes moved by words of each counted width

struct uint4 {
    unsigned int x, y, z, w;
    uint4& operator=(const uint4& o) { x = o.x; y = o.y; z = o.z; w = o.w; moved[16] += 16; return *this; }
};
struct uint2 {
    unsigned int x, y;
    uint2& operator=(const uint2& o) { x = o.x; y = o.y; moved[8] += 8; return *this; }
};
static inline long long min(long long a, long long b) { return a < b ? a : b; }

#include "kv_copy.cu"

extern "C" void run(int gather, const unsigned long long* src, const long long* stride, const long long* len,
                    const long long* off, const long long* ids, char* stage, long long pitch, long long parts,
                    unsigned int grid_x, unsigned int grid_y, unsigned int threads) {
    blockDim = dim3{threads, 1, 1};
    gridDim = dim3{grid_x, grid_y, 1};
    for (unsigned int y = 0; y < grid_y; ++y)
        for (unsigned int x = 0; x < grid_x; ++x) {
            blockIdx = dim3{x, y, 0};
            for (unsigned int t = 0; t < threads; ++t) {
                threadIdx = dim3{t, 0, 0};
                if (gather) kv_gather(src, stride, len, off, ids, stage, pitch, parts);
                else kv_scatter(src, stride, len, off, ids, stage, pitch, parts);
            }
        }
}

extern "C" unsigned long long moved_by(int width) { return moved[width]; }
extern "C" void reset_moved(void) { for (auto& m : moved) m = 0; }
