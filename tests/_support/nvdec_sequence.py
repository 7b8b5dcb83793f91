"""Run a sequence of video files through one process on NVDEC: ``python nvdec_sequence.py
FILE...``. Every file is opened with ``VideoDecoder(device="cuda")`` and a few frames are
decoded; a file whose content is bad must raise an ``avpipe.DecodeError`` (or decode, on the
CPU after a fallback), never end the process. Prints one line per file, then ``DONE``: the
caller checks that the process exits 0 and that the good files decode as on the CPU."""

from __future__ import annotations

import sys

import numpy as np

import avpipe


def main(paths):
    for p in paths:
        try:
            with avpipe.VideoDecoder(p, device="cuda") as d:
                n = d.metadata.num_frames
                idx = sorted({0, n // 2, n - 1})
                got = d.get_frames(idx).data
                import cupy

                got = cupy.asnumpy(got)
                with avpipe.VideoDecoder(p, device="cpu") as c:
                    want = c.get_frames(idx).data
                diff = int(np.abs(got.astype(int) - want.astype(int)).max())
                print(f"ok {p} backend={d.backend} frames={len(idx)} maxdiff={diff}", flush=True)
        except avpipe.DecodeError as e:
            print(f"typed {p} {type(e).__name__}", flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
