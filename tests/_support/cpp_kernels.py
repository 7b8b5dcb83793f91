"""Build a CUDA kernel source as plain C++ for a CPU test (the kernels' numpy-reference checks),
and compile-check it for the GPU with nvcc: the one place the tests do either."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

# C++ stand-ins for what a kernel launched one thread per block needs (the launchers set
# blockIdx.x in a loop): the prelude of the one-thread-per-element kernels' CPU tests
ELEMENTWISE_PRELUDE = r"""
#include <math.h>
#define __global__
struct Dim3 { unsigned x; };
static Dim3 threadIdx, blockIdx, blockDim;
"""


# C++ stand-ins for CUDA's keywords and launch indices for kernels that synchronize: threadIdx
# is per thread (thread_local), so a launcher can run a block's threads as real threads meeting
# at __syncthreads (a barrier of blockDim.x: block_barrier, initialized by the launcher), the
# block's __shared__ buffers statics they share (the launcher runs the blocks one after
# another). Build with flags=("-pthread",).
THREADS_PRELUDE = r"""
#include <math.h>
#include <pthread.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct Dim3 { unsigned x, y, z; };
static thread_local Dim3 threadIdx;
static Dim3 blockIdx, blockDim, gridDim;
static pthread_barrier_t block_barrier;
static inline void __syncthreads() { pthread_barrier_wait(&block_barrier); }
"""


def build(source: str, folder, *, flags=()):
    """``source`` (C++: a prelude standing in for CUDA's keywords, the kernels, extern "C"
    launchers) compiled with g++ / clang++ (-O2 -Wall -Werror, then ``flags``) into a shared
    library in ``folder``; the test is skipped where no C++ compiler is found."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the kernels for the CPU")
    src = folder / "k.cpp"
    src.write_text(source)
    so = folder / "k.so"
    subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-Wall", "-Werror", *flags, str(src), "-o",
                    str(so)], check=True)  # fmt: skip
    return ctypes.CDLL(str(so))


def ptx(source: str, folder, *, arch: str = "sm_90") -> str:
    """``source`` (CUDA) compiled by nvcc for ``arch``; the PTX text. Skipped without nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    src = folder / "k.cu"
    src.write_text(source)
    out = folder / "k.ptx"
    subprocess.run([nvcc, f"-arch={arch}", "--ptx", str(src), "-o", str(out)], check=True)
    return out.read_text()


class TablesOn:
    """A stand-in for cupy in ``avpipe.device.launch_table``: a device that reads launch
    tables (compute capability 9.0), to pack a table as a GPU launch would get it."""

    class cuda:
        class Device:
            def __init__(self, i=0):
                self.id = int(i)

            compute_capability = "90"
