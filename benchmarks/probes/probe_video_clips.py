#!/usr/bin/env python3
"""Where a clip's time goes in the clip benchmark (``benchmarks/workloads/video.py``'s ``avpipe_clip_cps``:
``ClipFeed.clip`` from a thread pool over the H.264 640x360 files, warm), per step.

    python -m benchmarks.probes.probe_video_clips --out DIR [--budget 4]

Runs the benchmark's avpipe contender with 16 threads, then with 1, each for ``--budget``
seconds, with the steps of a clip timed by name (``_timing``): the open, the frame selection,
NVDEC's part (the packets' read and conversion to Annex B, each ``Decode`` call of
PyNvVideoCodec, the RGB kernel per frame, the wait for the stream), the transform. Reported as
milliseconds per clip summed over the threads: with 1 thread they add up to the clip's latency;
with 16 the same steps, inflated by whatever they wait for (NVDEC, the GIL). Writes
DIR/probe_video_clips.txt."""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.harness import DEFAULT_DATA

TIMED = [
    ("avpipe.pipeline.clips", "decode_clip", "decode_clip (the whole clip)"),
    ("avpipe.decoding.video.VideoDecoder", "__init__", "VideoDecoder open"),
    ("avpipe.pipeline.samplers", "sample_random_clips", "sample_random_clips (decode incl.)"),
    ("avpipe.decoding.video._nvdec.NvdecBackend", "decode", "NvdecBackend.decode"),
    ("avpipe.decoding.video._nvdec.NvdecBackend", "_write", "frame write (RGB kernel launch)"),
    ("avpipe.decoding.video._nvdec_packets", "packet_feed", "packet_feed (pread + Annex B)"),
    ("avpipe.pipeline.clips.ClipFeed", "transform", "transform (resize + normalize)"),
]


class _TimedDecoder:
    """A PyNvVideoCodec decoder whose ``Decode`` calls are timed."""

    def __init__(self, dec, decode):
        self._dec, self.Decode = dec, decode

    def __getattr__(self, name):
        return getattr(self._dec, name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=4.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import cupy

    from avpipe.decoding.video import _nvdec_packets
    from benchmarks import _timing
    from benchmarks.workloads import video as bench_video

    acc = _timing.time_calls(TIMED)
    make = _nvdec_packets.PacketDecoder._decoder

    def decoder(self, *a, **k):
        dec = make(self, *a, **k)
        return _TimedDecoder(dec, _timing.timed(dec.Decode, "PyNvVideoCodec Decode call", acc))

    _nvdec_packets.PacketDecoder._decoder = decoder
    try:  # the waits for a stream (the decode's, the transform's), where the class allows it
        cupy.cuda.Stream.synchronize = _timing.timed(cupy.cuda.Stream.synchronize,
                                                     "Stream.synchronize", acc)
    except (TypeError, AttributeError):
        pass
    from benchmarks import data

    files = data.anchor_data(args.data)["h264"]
    lines = []
    for threads in (16, 1):
        bench_video.THREADS = threads
        acc.clear()
        cps, extra = bench_video.bench_avpipe(files, args.budget)
        clips = int(extra["clips"])
        # (the warm-up pass is counted in acc too: per clip over every clip it saw)
        seen = clips + len(files)
        lines.append(f"threads {threads}: {cps:.1f} clips/s ({clips} clips in "
                     f"{extra['seconds']} s); ms per clip summed over the threads "
                     f"({seen} clips with the warm-up pass):")
        lines.append(_timing.report(acc, seen, "clip"))
        print(lines[-2], flush=True)
        print(lines[-1], flush=True)
    with open(os.path.join(args.out, "probe_video_clips.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
