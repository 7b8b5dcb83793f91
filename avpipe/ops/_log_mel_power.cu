// The spectrum's power for avpipe/ops/_log_mel.py: the body of an elementwise kernel
// (complex64 X, int32 p -> float32 P), |X|^2 for p == 2 or |X| for p == 1, each product and
// the sum rounded as the array-module code rounds them (read through
// avpipe.device.cuda_modules.read_fragments).

//@@ power
float a = X.real(), b = X.imag();
P = __fadd_rn(__fmul_rn(a, a), __fmul_rn(b, b));
if (p == 1) P = sqrtf(P);
