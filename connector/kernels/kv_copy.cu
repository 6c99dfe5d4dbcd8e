// Fused gather / scatter between an engine's paged KV cache and a staging buffer of whole blocks.
//
// One launch moves every layer and plane of a chunk of blocks. The copy plan
// (connector/copy_plan.py) cuts one block into pieces, byte ranges contiguous both in the cache
// and in the block's slot: piece p of block b is the cache's bytes
// [src[p] + ids[i] * stride[p], + len[p]) and the staging bytes [i * pitch + off[p], + len[p]).
// Grid: x = piece, y = position of the block in the chunk; a thread block copies one piece.
// 16-byte loads where both ends and the length allow it, then the tail (or the whole piece, when
// unaligned) byte by byte. Compiled by cupy (NVRTC) at first use.

__device__ __forceinline__ void copy_piece(char* __restrict__ dst, const char* __restrict__ src, long long n) {
    long long words = 0;
    if ((((unsigned long long)dst | (unsigned long long)src) & 15ULL) == 0) {
        words = n >> 4;
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (long long k = threadIdx.x; k < words; k += blockDim.x) d[k] = s[k];
    }
    for (long long k = (words << 4) + threadIdx.x; k < n; k += blockDim.x) dst[k] = src[k];
}

extern "C" __global__ void kv_gather(const unsigned long long* __restrict__ src, const long long* __restrict__ stride,
                                     const long long* __restrict__ len, const long long* __restrict__ off,
                                     const long long* __restrict__ ids, char* __restrict__ stage, long long pitch) {
    const int p = blockIdx.x, i = blockIdx.y;
    const char* from = reinterpret_cast<const char*>(src[p] + ids[i] * stride[p]);
    copy_piece(stage + i * pitch + off[p], from, len[p]);
}

extern "C" __global__ void kv_scatter(const unsigned long long* __restrict__ src, const long long* __restrict__ stride,
                                      const long long* __restrict__ len, const long long* __restrict__ off,
                                      const long long* __restrict__ ids, const char* __restrict__ stage, long long pitch) {
    const int p = blockIdx.x, i = blockIdx.y;
    char* to = reinterpret_cast<char*>(src[p] + ids[i] * stride[p]);
    copy_piece(to, stage + i * pitch + off[p], len[p]);
}
