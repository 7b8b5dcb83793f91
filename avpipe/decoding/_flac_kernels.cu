// FLAC decoding on the GPU: one thread per frame (private; host side in _flac_cuda.py).
//
// A FLAC stream is a sequence of independent frames, each starting with a byte-aligned sync
// code and a header protected by CRC-8, and ending with a CRC-16 over the whole frame. The host
// only parses STREAMINFO; everything else runs here, in three kernels:
//
//   flac_scan    one thread per byte: is a frame header (sync, legal fields that agree with
//                STREAMINFO, CRC-8) at this byte? -> flags[byte], and the candidate's position
//                appended to a list.
//   flac_frames  one thread per candidate. mode 0 ("check"): parse the frame to its end without
//                writing, verify the CRC-16 and that the frame ends where another candidate or
//                the file ends; a frame that passes is valid and adds its block size to its
//                file's coverage. mode 1 ("decode"): decode the valid frames into int32 PCM
//                (planar per file: channel c at pcm_off + c * total + first sample).
//   flac_to_float  PCM -> padded float32 [B, max_len] (x / 2^(bps-1), as libsndfile scales;
//                several channels are averaged), zero past each file's length.
//
// A file whose valid frames do not cover exactly its STREAMINFO sample count (a frame the GPU
// could not decode, a feature not handled here, a false sync that survived, ...) is reported
// by the host, which decodes that file on the CPU instead: the GPU path never returns a sample
// that libFLAC would not.
//
// This file is also compiled as plain C++ for the CPU test of the kernels
// (tests/test_flac_kernels_cpu.py); the prelude there maps the few CUDA names used here.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

// ---- bit reader: big-endian, over the whole batch buffer (reads past its end give zeros) ----
struct Bits {
    const u8* buf;
    i64 nbytes;
    i64 byte;   // next byte to load
    u64 cache;  // unread bits, left-aligned; bits past `count` are zero
    int count;
};

__device__ __forceinline__ void br_init(Bits& b, const u8* buf, i64 nbytes, i64 byte) {
    b.buf = buf; b.nbytes = nbytes; b.byte = byte; b.cache = 0; b.count = 0;
}
__device__ __forceinline__ void br_fill(Bits& b) {
    while (b.count <= 56) {
        u64 v = b.byte < b.nbytes ? (u64)b.buf[b.byte] : 0;
        b.byte++;
        b.cache |= v << (56 - b.count);
        b.count += 8;
    }
}
__device__ __forceinline__ i64 br_pos(const Bits& b) { return b.byte * 8 - b.count; }
__device__ __forceinline__ u32 br_read(Bits& b, int n) {  // 0 <= n <= 32
    if (n == 0) return 0;
    if (b.count < n) br_fill(b);
    u32 v = (u32)(b.cache >> (64 - n));
    b.cache <<= n;
    b.count -= n;
    return v;
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
};

__device__ __forceinline__ int item_of(const i64* istart, int n_items, i64 p) {
    int lo = 0, hi = n_items - 1;
    while (lo < hi) {  // last item with istart <= p
        int mid = (lo + hi + 1) >> 1;
        if (istart[mid] <= p) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// meta per item: [channels, bits per sample, nominal block size, sample rate]
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
    } else if (type >= 8 && type <= 12) {
        int order = type - 8;
        if (order > bs) return 0;
        for (int i = 0; i < order; i++) {
            i32 v = br_sread(b, sbps);
            if (out) out[i] = v;
        }
        if (!read_residual(b, limit, bs, order, out)) return 0;
        if (out) {
            switch (order) {
                case 1: for (int i = 1; i < bs; i++) out[i] += out[i - 1]; break;
                case 2: for (int i = 2; i < bs; i++) out[i] += 2 * out[i - 1] - out[i - 2]; break;
                case 3:
                    for (int i = 3; i < bs; i++)
                        out[i] += 3 * (out[i - 1] - out[i - 2]) + out[i - 3];
                    break;
                case 4:
                    for (int i = 4; i < bs; i++)
                        out[i] += 4 * (out[i - 1] + out[i - 3]) - 6 * out[i - 2] - out[i - 4];
                    break;
                default: break;
            }
        }
    } else if (type >= 32) {
        int order = type - 31;
        if (order > bs) return 0;
        for (int i = 0; i < order; i++) {
            i32 v = br_sread(b, sbps);
            if (out) out[i] = v;
        }
        int precision = br_read(b, 4);
        if (precision == 15) return 0;
        precision++;
        int shift = br_sread(b, 5);
        if (shift < 0) return 0;
        i32 coef[32];
        for (int j = 0; j < order; j++) coef[j] = br_sread(b, precision);
        if (!read_residual(b, limit, bs, order, out)) return 0;
        if (out) {
            for (int i = order; i < bs; i++) {
                i64 sum = 0;
                for (int j = 0; j < order; j++) sum += (i64)coef[j] * (i64)out[i - 1 - j];
                out[i] += (i32)(sum >> shift);
            }
        }
    } else {
        return 0;  // reserved subframe type
    }
    if (wasted && out)
        for (int i = 0; i < bs; i++) out[i] = (i32)((u32)out[i] << wasted);
    return br_pos(b) <= limit;
}

// ---- kernels ----
extern "C" __global__ void flac_scan(const u8* data, i64 nbytes, const i64* istart,
                                     const i64* iend, const i32* imeta, const i64* itotal,
                                     int n_items, const u8* crc8, u8* flags, i64* cand,
                                     int* n_cand, int cap) {
    i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (p + 1 >= nbytes) return;
    if (data[p] != 0xFF || (data[p + 1] & 0xFE) != 0xF8) return;
    int it = item_of(istart, n_items, p);
    if (p < istart[it] || p >= iend[it]) return;
    Hdr h;
    if (!parse_header(data, p, iend[it], imeta + 4 * it, itotal[it], crc8, h)) return;
    flags[p] = 1;
    int k = atomicAdd(n_cand, 1);
    if (k < cap) cand[k] = p;
}

extern "C" __global__ void flac_frames(const u8* data, i64 nbytes, const i64* istart,
                                       const i64* iend, const i32* imeta, const i64* itotal,
                                       int n_items, const u8* crc8, const u16* crc16,
                                       const u8* flags, const i64* cand, const int* n_cand,
                                       int cap, int mode, u8* valid, u64* cover, i32* pcm,
                                       const i64* ipcm) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    int n = *n_cand;
    if (n > cap) n = cap;
    if (t >= n) return;
    if (mode == 1 && !valid[t]) return;
    i64 p = cand[t];
    int it = item_of(istart, n_items, p);
    i64 end = iend[it];
    i64 total = itotal[it];
    Hdr h;
    if (!parse_header(data, p, end, imeta + 4 * it, total, crc8, h)) return;
    if (h.bps > 24) return;  // 32-bit: side channels need 33 bits; left to the CPU
    i32* out = mode == 1 ? pcm + ipcm[it] + h.first : (i32*)0;
    Bits b;
    br_init(b, data, nbytes, p + h.len);
    i64 limit = end * 8;
    for (int c = 0; c < h.nch; c++) {
        int sbps = h.bps;
        if ((h.assign == 8 && c == 1) || (h.assign == 9 && c == 0) || (h.assign == 10 && c == 1))
            sbps++;
        if (!read_subframe(b, limit, h.bs, sbps, out ? out + (i64)c * total : (i32*)0)) return;
    }
    if (mode == 0) {
        i64 stop = (br_pos(b) + 7) >> 3;  // byte-aligned end of the subframes
        if (stop + 2 > end) return;
        u32 crc = 0;
        for (i64 k = p; k < stop; k++) crc = ((crc << 8) ^ crc16[((crc >> 8) ^ data[k]) & 0xFF]) & 0xFFFF;
        if (crc != (((u32)data[stop] << 8) | data[stop + 1])) return;
        i64 next = stop + 2;
        if (!(next == end || flags[next] || (total > 0 && h.first + h.bs == total))) return;
        valid[t] = 1;
        atomicAdd(cover + it, (u64)h.bs);
    } else if (h.assign >= 8) {
        i32* c0 = out;
        i32* c1 = out + total;
        for (int i = 0; i < h.bs; i++) {
            i32 a = c0[i], s = c1[i];
            if (h.assign == 8) c1[i] = a - s;          // left, side -> right = left - side
            else if (h.assign == 9) c0[i] = a + s;     // side, right -> left = side + right
            else {                                     // mid, side
                i32 m = (i32)(((u32)a << 1) | (u32)(s & 1));
                c0[i] = (m + s) >> 1;
                c1[i] = (m - s) >> 1;
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
    int nch = imeta[4 * it];
    float scale = 1.0f / (float)(1u << (imeta[4 * it + 1] - 1));
    const i32* src = pcm + ipcm[it] + j;
    if (nch == 1) { out[k] = (float)src[0] * scale; return; }
    float acc = 0.0f;
    for (int c = 0; c < nch; c++) acc += (float)src[(i64)c * total] * scale;
    out[k] = acc / (float)nch;
}
