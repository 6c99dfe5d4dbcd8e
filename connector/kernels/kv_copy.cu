// Fused gather / scatter between an engine's paged KV cache and a staging buffer of whole blocks.
//
// One launch moves every layer and plane of a chunk of blocks. The copy plan
// (connector/copy_plan.py) cuts one block into pieces, byte ranges contiguous both in the cache
// and in the block's slot: piece p of block b is the cache's bytes
// [src[p] + ids[i] * stride[p], + len[p]) and the staging bytes [i * pitch + off[p], + len[p]).
// Grid: x = piece * parts + part, y = position of the block in the chunk; a thread block copies
// one part of a piece (a large piece, such as a cross-layer block, is cut into `parts` so the
// launch fills the GPU). 16-byte loads where both ends are aligned, the tail (under 16 bytes) by
// part 0; bytes throughout, split the same way, where they are not. Compiled by cupy (NVRTC) at
// first use.

__device__ __forceinline__ void copy_part(char* __restrict__ dst, const char* __restrict__ src, long long n,
                                          long long part, long long parts) {
    if ((((unsigned long long)dst | (unsigned long long)src) & 15ULL) == 0) {
        const long long words = n >> 4;
        const long long per = (words + parts - 1) / parts;
        const long long w1 = min(words, (part + 1) * per);
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (long long k = part * per + threadIdx.x; k < w1; k += blockDim.x) d[k] = s[k];
        if (part == 0)
            for (long long k = (words << 4) + threadIdx.x; k < n; k += blockDim.x) dst[k] = src[k];
    } else {
        const long long per = (n + parts - 1) / parts;
        const long long b1 = min(n, (part + 1) * per);
        for (long long k = part * per + threadIdx.x; k < b1; k += blockDim.x) dst[k] = src[k];
    }
}

extern "C" __global__ void kv_gather(const unsigned long long* __restrict__ src, const long long* __restrict__ stride,
                                     const long long* __restrict__ len, const long long* __restrict__ off,
                                     const long long* __restrict__ ids, char* __restrict__ stage, long long pitch,
                                     long long parts) {
    const long long p = blockIdx.x / parts, q = blockIdx.x % parts, i = blockIdx.y;
    const char* from = reinterpret_cast<const char*>(src[p] + ids[i] * stride[p]);
    copy_part(stage + i * pitch + off[p], from, len[p], q, parts);
}

extern "C" __global__ void kv_scatter(const unsigned long long* __restrict__ src, const long long* __restrict__ stride,
                                      const long long* __restrict__ len, const long long* __restrict__ off,
                                      const long long* __restrict__ ids, const char* __restrict__ stage,
                                      long long pitch, long long parts) {
    const long long p = blockIdx.x / parts, q = blockIdx.x % parts, i = blockIdx.y;
    char* to = reinterpret_cast<char*>(src[p] + ids[i] * stride[p]);
    copy_part(to, stage + i * pitch + off[p], len[p], q, parts);
}
