"""Typed-field attacks on item lists: NeMo manifest lines and CSV rows with fields of the wrong
type, huge numbers, bools, NaN / Infinity, bytes that are not UTF-8, missing fields and paths
climbing out of the data folder.

:func:`cases` gives ``(name, kind, data)``: ``kind`` "jsonl" or "csv", ``data`` the file's
bytes (one good line, then the attack, then one good line, so a reader that stops early or
loses its place shows). The same ``seed`` gives the same cases. Every case must give a typed
error (:class:`avpipe.errors.ManifestError`, :class:`avpipe.errors.OutsideRootError`) or a
clean result, never another exception.

::

    python -m tests.fuzz.manifest_attacks --out /tmp/attacks --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random

GOOD = {"audio_filepath": "a.wav", "duration": 1.0, "text": "ok"}

# values of every JSON type, and the edges of numbers
VALUES = [
    None, True, False, 0, -1, 1.5, -0.0, "1.5", "", "x", [], [1], {}, {"a": 1},
    10 ** 400, -(10 ** 400), 2 ** 63, 1e308, "NaN",
]
# JSON text that json.dumps cannot write: numbers beyond float range, NaN, Infinity
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" + "0" * 400,
               "1" + "0" * 5000, "1e-400", "0.1e1", "-0"]
FIELDS = ["audio_filepath", "duration", "offset", "text", "label", "extra"]
PATHS = ["../../etc/passwd", "/etc/passwd", "a/../../b.wav", "~/x.wav", "", " ", "a.wav\x00",
         "ok\u00e9.wav"]
BAD_BYTES = [b"\xe9", b"\xff\xfe", b"\xc3", b"\xed\xa0\x80", b"\x80abc"]


def _line(d) -> bytes:
    return json.dumps(d, allow_nan=True).encode()


def _jsonl(attack: bytes) -> bytes:
    return _line(GOOD) + b"\n" + attack + b"\n" + _line({**GOOD, "audio_filepath": "b.wav"}) + b"\n"


def cases(seed: int = 0, random_cases: int = 64) -> list[tuple[str, str, bytes]]:
    rng = random.Random(seed)
    out: list[tuple[str, str, bytes]] = []
    for f in FIELDS:
        for i, v in enumerate(VALUES):
            out.append((f"type-{f}-{i}", "jsonl", _jsonl(_line({**GOOD, f: v}))))
        for i, raw in enumerate(RAW_NUMBERS):
            text = _line({**GOOD, f: 0}).replace(f'"{f}": 0'.encode(), f'"{f}": {raw}'.encode())
            out.append((f"number-{f}-{i}", "jsonl", _jsonl(text)))
        missing = {k: v for k, v in GOOD.items() if k != f}
        out.append((f"missing-{f}", "jsonl", _jsonl(_line(missing))))
    for i, p in enumerate(PATHS):
        out.append((f"path-{i}", "jsonl", _jsonl(_line({**GOOD, "audio_filepath": p}))))
        out.append((f"csv-path-{i}", "csv", f"path,label\na.wav,x\n{p},y\nb.wav,z\n".encode()))
    for i, b in enumerate(BAD_BYTES):
        out.append((f"bytes-{i}", "jsonl", _jsonl(b'{"audio_filepath": "caf' + b + b'.wav"}')))
        out.append((f"csv-bytes-{i}", "csv", b"path,label\na.wav,x\ncaf" + b + b".wav,y\n"))
    for i, t in enumerate([b"", b"[", b"{", b"[]", b"[1]", b"null", b"1", b'"s"', b"{}",
                           b'{"audio_filepath": "a.wav"', b"\xef\xbb\xbf" + _line(GOOD),
                           b"[" * 100000 + b"]" * 100000,
                           b'{"audio_filepath": "a.wav", "x": ' + b"[" * 50000 + b"]" * 50000
                           + b"}"]):
        out.append((f"json-{i}", "jsonl", _jsonl(t)))
    for i, t in enumerate([b"path,label\na.wav,\n", b"path,label\na.wav\n",
                           b"path,label\na.wav,x,extra\n", b"file,cls\na.wav,x\n",
                           b'path,label\n"a.wav,x\n', b"path,label\n,x\n", b""]):
        out.append((f"csv-{i}", "csv", t))
    # a whole file holding one JSON array of rows
    for i, t in enumerate([b'[{"audio_filepath": 3}]', b"[1, null]", b"[NaN]", b"[" * 100000,
                           b'[{"audio_filepath": "a.wav", "duration": true}]', b"[]",
                           b'[{"audio_filepath": "a.wav"}, {"audio_filepath": "/etc/passwd"}]',
                           b'{"audio_filepath": "a.wav"}']):
        out.append((f"array-{i}", "jsonl", t))
    # random: a good line with a few fields replaced by random values / raw numbers
    for i in range(random_cases):
        d = dict(GOOD)
        for _ in range(rng.randint(1, 3)):
            d[rng.choice(FIELDS)] = rng.choice(VALUES)
        line = _line(d)
        if rng.random() < 0.3:
            line = line.replace(b"1.0", rng.choice(RAW_NUMBERS).encode(), 1)
        if rng.random() < 0.2:
            k = rng.randrange(len(line))
            line = line[:k] + rng.choice(BAD_BYTES) + line[k:]
        out.append((f"random-{i}", "jsonl", _jsonl(line)))
    return out


def write(folder, seed: int = 0) -> list[str]:
    """Write every case as ``folder/NAME.jsonl`` / ``.csv``; returns the paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, kind, data in cases(seed):
        p = os.path.join(folder, f"{name}.{kind}")
        with open(p, "wb") as f:
            f.write(data)
        paths.append(p)
    return paths


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(f"{len(write(a.out, a.seed))} cases in {a.out}")
