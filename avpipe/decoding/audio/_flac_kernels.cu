// FLAC decoding on the GPU: one thread per frame (private; host side in _flac_cuda.py).
//
// A FLAC stream is a sequence of independent frames, each starting with a byte-aligned sync
// code and a header protected by CRC-8, and ending with a CRC-16 over the whole frame. The host
// only parses STREAMINFO; everything else runs here:
//
//   flac_scan    one thread per byte: is a frame header (sync, legal fields that agree with
//                STREAMINFO, CRC-8) at this byte? -> flags[byte], the candidate's position
//                appended to a list, and, in a fixed-blocksize file, a claim on the frame
//                number it carries.
//   flac_frames  one thread per candidate.
//                mode 2 (fixed-blocksize files, one pass): a candidate that is the only claimant
//                of its frame number decodes straight into int32 PCM (planar per file: channel
//                c at pcm_off + c * total + first sample), then checks that the frame ends where
//                another candidate or the file ends and that its CRC-16 holds; a frame that
//                passes adds its block size to its file's coverage.
//                mode 0 / mode 1 (other files, two passes): 0 parses every candidate to its end
//                without writing and marks the ones that pass those checks valid; 1 decodes
//                the valid ones.
//   flac_to_float  PCM -> padded float32 [B, max_len] (x / 2^(bps-1), as libsndfile scales;
//                several channels are averaged), zero past each file's length.
//
// A file whose checked frames do not cover exactly its STREAMINFO sample count (a damaged
// frame, a feature not handled here, a false sync that survived, two claims on one frame
// number, ...) is reported by the host, which decodes that file on the CPU instead: the GPU path
// never returns a sample that libFLAC would not. (A frame that fails its checks in mode 2 has
// already written its samples, but only into its own file's rows, which the host replaces.)
//
// Speed: threads of a warp decode different frames, so the sample loop is written to keep
// them in step: residual decoding and prediction are one loop for FIXED and LPC subframes
// (fixed predictors are LPC with shift 0), with the history and coefficients in registers
// (orders up to 12; higher orders take a slower path); the bit reader loads aligned 32-bit
// words; the CRC-16 goes four bytes at a time through tables in shared memory.
//
// This file is also compiled as plain C++ for the CPU test of the kernels
// (tests/decoding/audio/test_flac_kernels_cpu.py); the prelude there maps the few CUDA names used here.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

// ---- bit reader: big-endian, over the whole batch buffer (reads past its end give zeros) ----
#if defined(__CUDA_ARCH__)
#define BSWAP32(x) __byte_perm((x), 0u, 0x0123u)
#else
#define BSWAP32(x) __builtin_bswap32(x)
#endif

struct Bits {
    const u8* buf;  // 4-byte aligned
    i64 nbytes;
    i64 word;   // next 32-bit word to load
    u64 cache;  // unread bits, left-aligned; bits past `count` are zero
    int count;
};

__device__ __forceinline__ u32 load_be32(const u8* buf, i64 nbytes, i64 word) {
    i64 at = word * 4;
    if (at + 4 <= nbytes) return BSWAP32(((const u32*)buf)[word]);
    u32 v = 0;
    for (int k = 0; k < 4; k++) v = (v << 8) | (at + k < nbytes ? (u32)buf[at + k] : 0u);
    return v;
}
__device__ __forceinline__ void br_fill(Bits& b) {
    while (b.count <= 32) {
        b.cache |= (u64)load_be32(b.buf, b.nbytes, b.word) << (32 - b.count);
        b.word++;
        b.count += 32;
    }
}
__device__ __forceinline__ i64 br_pos(const Bits& b) { return b.word * 32 - b.count; }
__device__ __forceinline__ u32 br_read(Bits& b, int n) {  // 0 <= n <= 32
    if (n == 0) return 0;
    if (b.count < n) br_fill(b);
    u32 v = (u32)(b.cache >> (64 - n));
    b.cache <<= n;
    b.count -= n;
    return v;
}
__device__ __forceinline__ void br_init(Bits& b, const u8* buf, i64 nbytes, i64 byte) {
    b.buf = buf; b.nbytes = nbytes; b.word = byte >> 2; b.cache = 0; b.count = 0;
    br_read(b, (int)(byte & 3) * 8);
}
__device__ __forceinline__ i32 br_sread(Bits& b, int n) {  // n-bit two's complement, n <= 32
    if (n == 0) return 0;
    u32 v = br_read(b, n);
    return (i32)(v << (32 - n)) >> (32 - n);
}
// zeros before the next 1 bit (which is consumed); 0 when the run passes limit_bit
__device__ __forceinline__ int br_unary(Bits& b, i64 limit_bit, u32* out) {
    u32 n = 0;
    for (;;) {
        if (b.cache != 0) {
            int lz = __clzll(b.cache);
            b.cache = lz == 63 ? 0 : b.cache << (lz + 1);
            b.count -= lz + 1;
            *out = n + (u32)lz;
            return 1;
        }
        n += (u32)b.count;
        b.count = 0;
        if (br_pos(b) > limit_bit) return 0;
        br_fill(b);
    }
}

// ---- frame header ----
struct Hdr {
    int bs;        // samples per channel in this frame
    int assign;    // channel assignment code: 0-7 independent (channels = code + 1), 8 L/S, 9 S/R, 10 M/S
    int nch;
    int bps;
    int len;       // header bytes including the CRC-8
    i64 first;     // first sample of the frame in its file
    int variable;  // blocking strategy bit: the header carries a sample number
    u64 num;       // the frame number (fixed) or sample number (variable) it carries
};

__device__ __forceinline__ int item_of(const i64* istart, int n_items, i64 p) {
    int lo = 0, hi = n_items - 1;
    while (lo < hi) {  // last item with istart <= p
        int mid = (lo + hi + 1) >> 1;
        if (istart[mid] <= p) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// meta per item: channels, bits per sample, nominal block size, sample rate, ... (see META)
__device__ int parse_header(const u8* d, i64 p, i64 end, const i32* meta, i64 total,
                            const u8* crc8, Hdr& h) {
    if (p + 6 > end) return 0;
    if (d[p] != 0xFF || (d[p + 1] & 0xFE) != 0xF8) return 0;
    int variable = d[p + 1] & 1;
    int bs_code = d[p + 2] >> 4, sr_code = d[p + 2] & 15;
    int ch_code = d[p + 3] >> 4, ss_code = (d[p + 3] >> 1) & 7;
    if (bs_code == 0 || sr_code == 15 || ch_code > 10 || ss_code == 3 || (d[p + 3] & 1)) return 0;
    i64 q = p + 4;
    u32 c = d[q++];
    u64 num;
    int extra;
    if (!(c & 0x80)) { num = c; extra = 0; }
    else if ((c & 0xE0) == 0xC0) { num = c & 0x1F; extra = 1; }
    else if ((c & 0xF0) == 0xE0) { num = c & 0x0F; extra = 2; }
    else if ((c & 0xF8) == 0xF0) { num = c & 0x07; extra = 3; }
    else if ((c & 0xFC) == 0xF8) { num = c & 0x03; extra = 4; }
    else if ((c & 0xFE) == 0xFC) { num = c & 0x01; extra = 5; }
    else if (c == 0xFE && variable) { num = 0; extra = 6; }
    else return 0;
    if (q + extra + 5 > end) return 0;
    for (int k = 0; k < extra; k++) {
        c = d[q++];
        if ((c & 0xC0) != 0x80) return 0;
        num = (num << 6) | (c & 0x3F);
    }
    int bs;
    if (bs_code == 1) bs = 192;
    else if (bs_code <= 5) bs = 576 << (bs_code - 2);
    else if (bs_code == 6) bs = d[q++] + 1;
    else if (bs_code == 7) { bs = ((d[q] << 8) | d[q + 1]) + 1; q += 2; }
    else bs = 256 << (bs_code - 8);
    int rate;
    switch (sr_code) {
        case 0: rate = meta[3]; break;
        case 1: rate = 88200; break;
        case 2: rate = 176400; break;
        case 3: rate = 192000; break;
        case 4: rate = 8000; break;
        case 5: rate = 16000; break;
        case 6: rate = 22050; break;
        case 7: rate = 24000; break;
        case 8: rate = 32000; break;
        case 9: rate = 44100; break;
        case 10: rate = 48000; break;
        case 11: rate = 96000; break;
        case 12: rate = d[q++] * 1000; break;
        case 13: rate = (d[q] << 8) | d[q + 1]; q += 2; break;
        default: rate = ((d[q] << 8) | d[q + 1]) * 10; q += 2; break;
    }
    if (q + 1 > end) return 0;
    u32 crc = 0;
    for (i64 k = p; k < q; k++) crc = crc8[crc ^ d[k]];
    if (crc != d[q]) return 0;
    q++;
    int nch = ch_code < 8 ? ch_code + 1 : 2;
    int bps;
    switch (ss_code) {
        case 0: bps = meta[1]; break;
        case 1: bps = 8; break;
        case 2: bps = 12; break;
        case 4: bps = 16; break;
        case 5: bps = 20; break;
        case 6: bps = 24; break;
        default: bps = 32; break;
    }
    if (nch != meta[0] || bps != meta[1] || rate != meta[3]) return 0;
    i64 first = variable ? (i64)num : (i64)num * (i64)meta[2];
    if (total > 0 && first + bs > total) return 0;
    h.bs = bs; h.assign = ch_code; h.nch = nch; h.bps = bps; h.len = (int)(q - p); h.first = first;
    h.variable = variable; h.num = num;
    return 1;
}

// ---- subframes ----
__device__ int read_residual(Bits& b, i64 limit, int bs, int order, i32* out) {
    int method = br_read(b, 2);
    if (method > 1) return 0;
    int pbits = method ? 5 : 4;
    u32 esc = method ? 31u : 15u;
    int porder = br_read(b, 4);
    int psize = bs >> porder;
    if ((psize << porder) != bs || psize < order) return 0;
    int parts = 1 << porder;
    int i = order;
    for (int part = 0; part < parts; part++) {
        int n = part == 0 ? psize - order : psize;
        u32 k = br_read(b, pbits);
        if (k == esc) {
            int nb = br_read(b, 5);
            for (int j = 0; j < n; j++, i++) {
                i32 v = br_sread(b, nb);
                if (out) out[i] = v;
            }
        } else {
            for (int j = 0; j < n; j++, i++) {
                u32 q;
                if (!br_unary(b, limit, &q)) return 0;
                u32 u = (q << k) | br_read(b, (int)k);
                if (out) out[i] = (i32)(u >> 1) ^ -(i32)(u & 1);
            }
        }
        if (br_pos(b) > limit) return 0;
    }
    return 1;
}

// ---- prediction ----
// Orders above HMAX: residuals first, then the prediction in a second loop (slower, rare:
// libFLAC's presets stop at order 12).
template <int ORDER>
__device__ void lpc_restore_t(i32* out, const i32* coef_in, int bs, int shift) {
    i32 c[ORDER], h[ORDER];  // h[0]: the latest sample
#pragma unroll
    for (int j = 0; j < ORDER; j++) { c[j] = coef_in[j]; h[j] = out[ORDER - 1 - j]; }
    for (int i = ORDER; i < bs; i++) {
        i64 sum = 0;
#pragma unroll
        for (int j = 0; j < ORDER; j++) sum += (i64)c[j] * (i64)h[j];
        i32 v = out[i] + (i32)(sum >> shift);
        out[i] = v;
#pragma unroll
        for (int j = ORDER - 1; j > 0; j--) h[j] = h[j - 1];
        h[0] = v;
    }
}

__device__ void lpc_restore(i32* out, const i32* coef, int bs, int order, int shift) {
    switch (order) {
#define LPC_CASE(n) case n: lpc_restore_t<n>(out, coef, bs, shift); break;
        LPC_CASE(13) LPC_CASE(14) LPC_CASE(15) LPC_CASE(16) LPC_CASE(17) LPC_CASE(18)
        LPC_CASE(19) LPC_CASE(20) LPC_CASE(21) LPC_CASE(22) LPC_CASE(23) LPC_CASE(24)
        LPC_CASE(25) LPC_CASE(26) LPC_CASE(27) LPC_CASE(28) LPC_CASE(29) LPC_CASE(30)
        LPC_CASE(31) LPC_CASE(32)
#undef LPC_CASE
        default: break;
    }
}

#define HMAX 12

// Orders up to HMAX (FIXED subframes are LPC with shift 0): one loop decodes each residual and
// adds the prediction, history and coefficients in registers, every thread of a warp running
// the same instructions per sample. `warm`: the order warm-up samples.
__device__ int read_predicted(Bits& b, i64 limit, int bs, int order, const i32* coef, int shift,
                              const i32* warm, i32* out) {
    int method = br_read(b, 2);
    if (method > 1) return 0;
    int pbits = method ? 5 : 4;
    u32 esc = method ? 31u : 15u;
    int porder = br_read(b, 4);
    int psize = bs >> porder;
    if ((psize << porder) != bs || psize < order) return 0;
    i32 c[HMAX], h[HMAX];
#pragma unroll
    for (int j = 0; j < HMAX; j++) {
        c[j] = j < order ? coef[j] : 0;
        h[j] = j < order ? warm[order - 1 - j] : 0;
    }
    int next = psize;  // where the current partition ends
    u32 k = br_read(b, pbits);
    int nb = k == esc ? (int)br_read(b, 5) : -1;
    for (int i = order; i < bs; i++) {
        if (i == next) {
            next += psize;
            k = br_read(b, pbits);
            nb = k == esc ? (int)br_read(b, 5) : -1;
            if (br_pos(b) > limit) return 0;
        }
        i32 r;
        if (nb >= 0) {
            r = br_sread(b, nb);
        } else {
            u32 q;
            if (!br_unary(b, limit, &q)) return 0;
            u32 u = (q << k) | br_read(b, (int)k);
            r = (i32)(u >> 1) ^ -(i32)(u & 1);
        }
        if (out) {
            i64 sum = 0;
#pragma unroll
            for (int j = 0; j < HMAX; j++) sum += (i64)c[j] * (i64)h[j];
            i32 v = r + (i32)(sum >> shift);
            out[i] = v;
#pragma unroll
            for (int j = HMAX - 1; j > 0; j--) h[j] = h[j - 1];
            h[0] = v;
        }
    }
    return br_pos(b) <= limit;
}

__device__ int read_subframe(Bits& b, i64 limit, int bs, int sbps, i32* out) {
    if (br_read(b, 1) != 0) return 0;
    int type = br_read(b, 6);
    int wasted = 0;
    if (br_read(b, 1)) {
        u32 k;
        if (!br_unary(b, limit, &k)) return 0;
        wasted = (int)k + 1;
        if (wasted >= sbps) return 0;
    }
    sbps -= wasted;
    if (type == 0) {
        i32 v = br_sread(b, sbps);
        if (out) for (int i = 0; i < bs; i++) out[i] = v;
    } else if (type == 1) {
        for (int i = 0; i < bs; i++) {
            i32 v = br_sread(b, sbps);
            if (out) out[i] = v;
        }
    } else if ((type >= 8 && type <= 12) || type >= 32) {
        int fixed = type < 32;
        int order = fixed ? type - 8 : type - 31;
        if (order > bs) return 0;
        i32 warm[32], coef[32];
        for (int i = 0; i < order; i++) {
            warm[i] = br_sread(b, sbps);
            if (out) out[i] = warm[i];
        }
        int shift = 0;
        if (fixed) {
            // the fixed predictors of orders 1-4 as LPC coefficients
            const i32 fc[4][4] = {{1, 0, 0, 0}, {2, -1, 0, 0}, {3, -3, 1, 0}, {4, -6, 4, -1}};
            for (int j = 0; j < order; j++) coef[j] = fc[order - 1][j];
        } else {
            int precision = br_read(b, 4);
            if (precision == 15) return 0;
            precision++;
            shift = br_sread(b, 5);
            if (shift < 0) return 0;
            for (int j = 0; j < order; j++) coef[j] = br_sread(b, precision);
        }
        if (order <= HMAX) {
            if (!read_predicted(b, limit, bs, order, coef, shift, warm, out)) return 0;
        } else {
            if (!read_residual(b, limit, bs, order, out)) return 0;
            if (out) lpc_restore(out, coef, bs, order, shift);
        }
    } else {
        return 0;  // reserved subframe type
    }
    if (wasted && out)
        for (int i = 0; i < bs; i++) out[i] = (i32)((u32)out[i] << wasted);
    return br_pos(b) <= limit;
}

// CRC-16 (polynomial 0x8005) of data[p, stop), four bytes at a time: tab[k * 256 + x] is the
// CRC of byte x followed by k zero bytes (the host builds the four tables).
__device__ u32 crc16_range(const u8* data, i64 p, i64 stop, const u16* tab) {
    u32 crc = 0;
    i64 k = p;
    for (; k < stop && (k & 3); k++) crc = ((crc << 8) ^ tab[((crc >> 8) ^ data[k]) & 0xFF]) & 0xFFFF;
    for (; k + 4 <= stop; k += 4) {
        u32 w = BSWAP32(*(const u32*)(data + k));
        crc = tab[768 + (((crc >> 8) ^ (w >> 24)) & 0xFF)] ^ tab[512 + ((crc ^ (w >> 16)) & 0xFF)]
            ^ tab[256 + ((w >> 8) & 0xFF)] ^ tab[w & 0xFF];
    }
    for (; k < stop; k++) crc = ((crc << 8) ^ tab[((crc >> 8) ^ data[k]) & 0xFF]) & 0xFFFF;
    return crc;
}

// ---- kernels ----
// per item, imeta[META * item + ...]: channels, bits per sample, nominal block size, sample
// rate, fixed blocksize (0/1), frames (fixed blocksize: claims[iclaim[item] + frame number])
#define META 6

extern "C" __global__ void flac_scan(const u8* data, i64 nbytes, const i64* istart,
                                     const i64* iend, const i32* imeta, const i64* itotal,
                                     int n_items, const u8* crc8, u8* flags, i64* cand,
                                     int* n_cand, int cap, const i64* iclaim, u32* claims) {
    i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (p + 1 >= nbytes) return;
    if (data[p] != 0xFF || (data[p + 1] & 0xFE) != 0xF8) return;
    int it = item_of(istart, n_items, p);
    if (p < istart[it] || p >= iend[it]) return;
    const i32* m = imeta + META * it;
    Hdr h;
    if (!parse_header(data, p, iend[it], m, itotal[it], crc8, h)) return;
    flags[p] = 1;
    int k = atomicAdd(n_cand, 1);
    if (k < cap) cand[k] = p;
    if (m[4] && !h.variable && h.num < (u64)m[5]) atomicAdd(claims + iclaim[it] + h.num, 1u);
}

extern "C" __global__ void flac_frames(const u8* data, i64 nbytes, const i64* istart,
                                       const i64* iend, const i32* imeta, const i64* itotal,
                                       int n_items, const u8* crc8, const u16* crc16,
                                       const u8* flags, const i64* cand, const int* n_cand,
                                       int cap, int mode, u8* valid, u64* cover, i32* pcm,
                                       const i64* ipcm, const i64* iclaim, const u32* claims) {
    __shared__ u16 tab[1024];
    for (int k = threadIdx.x; k < 1024; k += blockDim.x) tab[k] = crc16[k];
    __syncthreads();
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    int n = *n_cand;
    if (n > cap) n = cap;
    if (t >= n) return;
    if (mode == 1 && !valid[t]) return;
    i64 p = cand[t];
    int it = item_of(istart, n_items, p);
    const i32* m = imeta + META * it;
    if ((mode == 2) != (m[4] != 0)) return;  // mode 2: fixed-blocksize files; 0 and 1: others
    i64 end = iend[it];
    i64 total = itotal[it];
    Hdr h;
    if (!parse_header(data, p, end, m, total, crc8, h)) return;
    if (h.bps > 24) return;  // 32-bit: side channels need 33 bits; left to the CPU
    if (mode == 2 && (h.variable || h.num >= (u64)m[5] || claims[iclaim[it] + h.num] != 1)) return;
    i32* out = mode != 0 ? pcm + ipcm[it] + h.first : (i32*)0;
    Bits b;
    br_init(b, data, nbytes, p + h.len);
    i64 limit = end * 8;
    for (int c = 0; c < h.nch; c++) {
        int sbps = h.bps;
        if ((h.assign == 8 && c == 1) || (h.assign == 9 && c == 0) || (h.assign == 10 && c == 1))
            sbps++;
        if (!read_subframe(b, limit, h.bs, sbps, out ? out + (i64)c * total : (i32*)0)) return;
    }
    if (mode != 1) {  // the frame's checks: its CRC-16, and where it ends
        i64 stop = (br_pos(b) + 7) >> 3;  // byte-aligned end of the subframes
        if (stop + 2 > end) return;
        if (crc16_range(data, p, stop, tab) != (((u32)data[stop] << 8) | data[stop + 1])) return;
        i64 next = stop + 2;
        if (!(next == end || flags[next] || (total > 0 && h.first + h.bs == total))) return;
        if (mode == 0) valid[t] = 1;
        atomicAdd(cover + it, (u64)h.bs);
    }
    if (out && h.assign >= 8) {
        i32* c0 = out;
        i32* c1 = out + total;
        for (int i = 0; i < h.bs; i++) {
            i32 a = c0[i], s = c1[i];
            if (h.assign == 8) c1[i] = a - s;          // left, side -> right = left - side
            else if (h.assign == 9) c0[i] = a + s;     // side, right -> left = side + right
            else {                                     // mid, side
                i32 mid = (i32)(((u32)a << 1) | (u32)(s & 1));
                c0[i] = (mid + s) >> 1;
                c1[i] = (mid - s) >> 1;
            }
        }
    }
}

extern "C" __global__ void flac_to_float(const i32* pcm, const i64* ipcm, const i64* itotal,
                                         const i32* imeta, int n_items, i64 max_len,
                                         float* out) {
    i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (i64)n_items * max_len) return;
    int it = (int)(k / max_len);
    i64 j = k - (i64)it * max_len;
    i64 total = itotal[it];
    if (j >= total) { out[k] = 0.0f; return; }
    int nch = imeta[META * it];
    float scale = 1.0f / (float)(1u << (imeta[META * it + 1] - 1));
    const i32* src = pcm + ipcm[it] + j;
    if (nch == 1) { out[k] = (float)src[0] * scale; return; }
    float acc = 0.0f;
    for (int c = 0; c < nch; c++) acc += (float)src[(i64)c * total] * scale;
    out[k] = acc / (float)nch;
}
