// NV12 to RGB (or planar RGB with chw) of one frame, one thread per pixel: the kernel that
// avpipe/ops/color.py launches (nv12_planes_to_rgb), with the constants of its
// yuv_coefficients; nv12_to_rgb_reference is its numpy reference.
extern "C" __global__ void avpipe_nv12_to_rgb(
    const unsigned char* __restrict__ luma, const unsigned char* __restrict__ chroma,
    long long pitch, int height, int width, unsigned char* __restrict__ dst, int chw,
    float ys, float y0, float rv, float gu, float gv, float bu)
{
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x >= width || y >= height) return;
    float Y = (float)luma[(long long)y * pitch + x];
    const unsigned char* uvrow = chroma + (long long)(y / 2) * pitch;
    int cx = (x / 2) * 2;
    float U = (float)uvrow[cx] - 128.0f;
    float V = (float)uvrow[cx + 1] - 128.0f;
    float yy = (Y - y0) * ys;
    float r = yy + rv * V;
    float g = yy + gu * U + gv * V;
    float b = yy + bu * U;
    int ri = min(max(__float2int_rn(r), 0), 255);
    int gi = min(max(__float2int_rn(g), 0), 255);
    int bi = min(max(__float2int_rn(b), 0), 255);
    if (chw) {
        long long plane = (long long)height * width;
        long long o = (long long)y * width + x;
        dst[o] = (unsigned char)ri; dst[plane + o] = (unsigned char)gi; dst[2 * plane + o] = (unsigned char)bi;
    } else {
        long long o = ((long long)y * width + x) * 3;
        dst[o] = (unsigned char)ri; dst[o + 1] = (unsigned char)gi; dst[o + 2] = (unsigned char)bi;
    }
}
