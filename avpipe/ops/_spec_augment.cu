// SpecAugment on a GPU: the masks' draws into a table (one thread per item), their
// application from a table (one thread per cell), and both in one launch (a block per feature
// row drawing its item's masks into shared memory). The numpy references are
// sample_spec_augment_params and apply_spec_augment in avpipe/ops/audio_augment.py; the
// kernels equal them exactly. The source is compiled after ops.random's PHILOX_FUNCTION
// (avpipe_philox).
//
// A mask parameter table holds per item b, at p + b * ld: kf frequency-mask starts, kf widths,
// kt time-mask starts, kt widths (int64).

// Word j of (key, epoch, id): ops.random.words' counter (id low, id high, epoch, j / 4), lane
// j % 4.
__device__ inline unsigned int avpipe_word(unsigned int k0, unsigned int k1, long long id,
                                           unsigned int epoch, int j) {
    unsigned int o[4];
    unsigned long long u = (unsigned long long)id;
    avpipe_philox((unsigned int)u, (unsigned int)(u >> 32), epoch, (unsigned int)(j / 4), k0, k1,
                  o[0], o[1], o[2], o[3]);
    return o[j % 4];
}

// ops._augment_base.below: uniform on [0, span) by multiply-shift (span <= 0: 0)
__device__ inline long long avpipe_below(unsigned int w, long long span) {
    unsigned long long s = span > 0 ? (unsigned long long)span : 0ull;
    return (long long)(((unsigned long long)w * s) >> 32);
}

// Mask j of an item (sample_spec_augment_params' draws; j < kf: frequency mask j, else time
// mask j - kf): its start and width. Frequency masks from the stream key (fk0, fk1): width
// uniform on 0..fcap, start on 0..n_mels - fcap; time masks from (tk0, tk1): width uniform on
// 0..W, start on 0..max(0, length - W), with W = max(1, floor(length * time_width)) where frac,
// else time_width frames; adaptive >= 0: only the first min(kt, floor(length * adaptive))
// time masks keep their width. (Each word is drawn as words() draws it, a Philox call per
// word.)
__device__ inline void avpipe_spec_mask(
    int j, long long id, long long len, int kf, int kt, long long n_mels, long long fcap,
    double time_width, int frac, double adaptive, unsigned int fk0, unsigned int fk1,
    unsigned int tk0, unsigned int tk1, unsigned int epoch, long long* start,
    long long* width) {
    if (j < kf) {
        *width = avpipe_below(avpipe_word(fk0, fk1, id, epoch, j), fcap + 1);
        *start = avpipe_below(avpipe_word(fk0, fk1, id, epoch, kf + j), n_mels - fcap + 1);
        return;
    }
    int k = j - kf;
    long long W = frac ? (long long)floor((double)len * time_width) : (long long)time_width;
    if (frac && W < 1) W = 1;
    long long count = kt;
    if (adaptive >= 0.0) {
        long long c = (long long)floor((double)len * adaptive);
        count = c < kt ? c : kt;
    }
    long long room = len - W + 1 > 1 ? len - W + 1 : 1;
    long long w = avpipe_below(avpipe_word(tk0, tk1, id, epoch, k), W + 1);
    *width = k < count ? w : 0;
    *start = avpipe_below(avpipe_word(tk0, tk1, id, epoch, kt + k), room);
}

// The draws of item b into the table p (one thread per item: avpipe_spec_mask for each mask).
// ids and lens [B]: on the device, or (inl set) byte offsets into the launch's own table `tab`
// (device/launch_table.cuh, compiled before this file); lens_out (or null): the lengths written
// to the device, for the masks.
extern "C" __global__ void avpipe_spec_augment_draw(
    const long long* ids, const long long* lens, long long B, int kf, int kt, long long n_mels,
    long long fcap, double time_width, int frac, double adaptive, unsigned int fk0,
    unsigned int fk1, unsigned int tk0, unsigned int tk1, unsigned int epoch, long long* p,
    long long ld, long long* lens_out, const AVP_GRID_CONST AvpTable tab, int inl) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    long long id = avp_tab(tab, inl, ids)[b], len = avp_tab(tab, inl, lens)[b];
    if (lens_out) lens_out[b] = len;
    long long* q = p + b * ld;
    for (int j = 0; j < kf + kt; ++j) {
        long long st, w;
        avpipe_spec_mask(j, id, len, kf, kt, n_mels, fcap, time_width, frac, adaptive, fk0, fk1,
                         tk0, tk1, epoch, &st, &w);
        if (j < kf) {
            q[j] = st;
            q[kf + j] = w;
        } else {
            q[kf + j] = st;           // 2 kf + k
            q[kf + kt + j] = w;       // 2 kf + kt + k
        }
    }
}

// The masks applied to x [B, F, T] (float32): a cell (b, f, t) with t < lens[b] is set to
// `value` when f lies in a frequency mask [start, start + width) or t in a time mask [start,
// min(start + width, length)); cells at or past the length are copied unchanged. The table's
// four blocks may lie anywhere: fs, fw, ts, tw point at item 0's first entry of each, every
// item's row `ld` entries after the previous one.
extern "C" __global__ void avpipe_spec_augment(
    const float* x, float* out, const long long* lens, const long long* fs,
    const long long* fw, const long long* ts, const long long* tw, long long ld, int kf, int kt,
    long long F, long long T, long long total, float value) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    long long t = i % T;
    long long f = (i / T) % F;
    long long b = i / (T * F);
    long long len = lens[b], row = b * ld;
    bool m = false;
    if (t < len) {
        for (int k = 0; k < kf; ++k) {
            long long s = fs[row + k], w = fw[row + k];
            if (f >= s && f < s + w) m = true;
        }
        for (int k = 0; k < kt; ++k) {
            long long s = ts[row + k], w = tw[row + k];
            long long e = s + w < len ? s + w : len;
            if (t >= s && t < e) m = true;
        }
    }
    out[i] = m ? value : x[i];
}

// The most masks (kf + kt) the fused kernel draws into shared memory.
#define AVPIPE_SPEC_MAX_MASKS 256

// Draws and masks in one launch: block (f, b) (gridDim.y over the frequencies, z over the
// items, both striding) draws item b's masks into shared memory (avpipe_spec_mask, a thread
// per mask) and sets its row f of x [B, F, T] (float32) as avpipe_spec_augment does, its
// threads over the frames. copy: out is another array, every cell written (the unmasked ones
// copied); else out is x itself and only the masked cells are written. kf + kt at most
// AVPIPE_SPEC_MAX_MASKS; ids and lens (frames) as in avpipe_spec_augment_draw.
extern "C" __global__ void avpipe_spec_augment_fused(
    const float* x, float* out, int copy, const long long* ids, const long long* lens,
    long long B, int kf, int kt, long long n_mels, long long fcap, double time_width, int frac,
    double adaptive, unsigned int fk0, unsigned int fk1, unsigned int tk0, unsigned int tk1,
    unsigned int epoch, long long T, float value, const AVP_GRID_CONST AvpTable tab, int inl) {
    __shared__ long long lo[AVPIPE_SPEC_MAX_MASKS], hi[AVPIPE_SPEC_MAX_MASKS];
    const long long* I = avp_tab(tab, inl, ids);
    const long long* L = avp_tab(tab, inl, lens);
    for (long long b = blockIdx.z; b < B; b += gridDim.z) {
        long long id = I[b], len = L[b];
        for (long long f = blockIdx.y; f < n_mels; f += gridDim.y) {
            __syncthreads();  // the previous row's reads of lo / hi are done
            for (int j = threadIdx.x; j < kf + kt; j += blockDim.x) {
                long long st, w;
                avpipe_spec_mask(j, id, len, kf, kt, n_mels, fcap, time_width, frac, adaptive,
                                 fk0, fk1, tk0, tk1, epoch, &st, &w);
                lo[j] = st;
                hi[j] = j < kf || st + w < len ? st + w : len;  // a time mask ends at the length
            }
            __syncthreads();
            bool fm = false;
            for (int j = 0; j < kf; ++j) fm = fm || (f >= lo[j] && f < hi[j]);
            const float* src = x + (b * n_mels + f) * T;
            float* dst = out + (b * n_mels + f) * T;
            for (long long t = threadIdx.x; t < T; t += blockDim.x) {
                bool m = false;
                if (t < len) {
                    m = fm;
                    for (int j = kf; j < kf + kt; ++j) m = m || (t >= lo[j] && t < hi[j]);
                }
                if (m) dst[t] = value;
                else if (copy) dst[t] = src[t];
            }
        }
    }
}
