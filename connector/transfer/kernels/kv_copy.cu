// Fused gather / scatter between an engine's paged KV cache and a staging buffer of whole blocks.
//
// One launch moves every layer and plane of a chunk of blocks. The copy plan
// (connector/transfer/plan.py) cuts one block into pieces, byte ranges contiguous both in the cache
// and in the block's slot: piece p of block b is the cache's bytes
// [src[p] + ids[i] * stride[p], + len[p]) and the staging bytes [i * pitch + off[p], + len[p]).
// Grid: x = piece * parts + part, y = position of the block in the chunk; a thread block copies
// one part of a piece (a large piece, such as a cross-layer block, is cut into `parts` so the
// launch fills the GPU). Words of the widest alignment both ends share: 16-byte loads where the
// two addresses agree modulo 16 (after a head of under 16 bytes), 8-byte where they agree modulo 8,
// and so on down to bytes; the head and the tail (under a word) by one thread block. Compiled by
// cupy (NVRTC) at first use; the CPU tests compile this file with a host shim
// (tests/support/kv_copy_host.cpp) and run it byte for byte against the plan.

template <typename W>
__device__ __forceinline__ void copy_words(char* __restrict__ dst, const char* __restrict__ src, long long n,
                                           long long part, long long parts) {
    // dst and src are aligned to sizeof(W): the words split between the parts, the tail by the last
    const long long size = (long long)sizeof(W);
    const long long words = n / size;
    const long long per = (words + parts - 1) / parts;
    const long long w1 = min(words, (part + 1) * per);
    const W* s = reinterpret_cast<const W*>(src);
    W* d = reinterpret_cast<W*>(dst);
    for (long long k = part * per + threadIdx.x; k < w1; k += blockDim.x) d[k] = s[k];
    if (part == parts - 1)
        for (long long k = words * size + threadIdx.x; k < n; k += blockDim.x) dst[k] = src[k];
}

__device__ __forceinline__ void copy_part(char* __restrict__ dst, const char* __restrict__ src, long long n,
                                          long long part, long long parts) {
    const unsigned long long a = (unsigned long long)dst, b = (unsigned long long)src;
    const unsigned long long skew = (a ^ b) | 16ULL;
    const unsigned long long width = skew & (~skew + 1ULL);  // the lowest bit where they differ: 1..16
    long long head = (long long)((width - (a & (width - 1ULL))) & (width - 1ULL));
    if (head > n) head = n;
    if (part == 0)
        for (long long k = threadIdx.x; k < head; k += blockDim.x) dst[k] = src[k];
    dst += head;
    src += head;
    n -= head;
    switch (width) {
        case 16: copy_words<uint4>(dst, src, n, part, parts); break;
        case 8: copy_words<uint2>(dst, src, n, part, parts); break;
        case 4: copy_words<unsigned int>(dst, src, n, part, parts); break;
        case 2: copy_words<unsigned short>(dst, src, n, part, parts); break;
        default: copy_words<unsigned char>(dst, src, n, part, parts); break;
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
