#!/usr/bin/env python3
"""A simulated TDX platform for tests and `make rehearse`: never part of the gateway.

`FakeTdx` stands in for both kernel interfaces that tinygw uses, and is honest about
what matters, that RTMR3 moves only by what is written into it, never by the event
log. Its register file is a FIFO that a thread reads, extending the register by each
48-byte write as the kernel's sysfs file does (a regular file would keep only the
last write). Its report directory is a plain one: for each new entry with a 64-byte
`inblob` a second thread writes `generation`, `provider` and, last, an `outblob` laid
out as a TDX quote v4, with the register's RTMR3 at offset 520 and the inblob as
REPORTDATA at offset 568. It signs nothing: no quote it makes passes Intel DCAP
verification (the tests check that it fails).

Run as a command, `attest/fake_tdx.py QUOTE` is the SIMULATED signature check that
`make rehearse` hands to `attest/verify --platform-verifier`: it exits 0 for a quote
this module laid out (an all-zero signature) and says SIMULATED; it proves nothing.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

# Where the TD quote body holds each field (TDX 1.0 TDREPORT): offset and size.
BODY_FIELDS = {
    "mrseam": (16, 48),
    "td_attributes": (120, 8),
    "xfam": (128, 8),
    "mrtd": (136, 48),
    "rtmr0": (328, 48),
    "rtmr1": (376, 48),
    "rtmr2": (424, 48),
}
UNSIGNED = bytes(4096)


def tdx_quote_v4(
    rtmr3: bytes, report_data: bytes, fields: dict[str, bytes] | None = None, signature: bytes = UNSIGNED
) -> bytes:
    """`fields`: body fields to set (BODY_FIELDS' names), the others zero. `signature`: the
    quote's signature data; a real one holds the ECDSA signature and the PCK certificate
    chain (tests borrow a real quote's to carry its PCK certificate; nothing verifies)."""
    header = struct.pack("<HHI", 4, 2, 0x81) + bytes(40)  # version 4, ECDSA P-256 key, TEE type TDX
    body = bytearray(584)  # the TD quote body: TCB, MRSEAM, ..., MRTD, RTMR0-3, REPORTDATA
    for name, value in (fields or {}).items():
        at, size = BODY_FIELDS[name]
        if len(value) != size:
            raise ValueError(f"{name}: {size} bytes, not {len(value)}")
        body[at : at + size] = value
    body[472:520] = rtmr3
    body[520:584] = report_data
    return header + bytes(body) + struct.pack("<I", len(signature)) + signature


def simulated_signature_check(path: str) -> int:
    """The SIMULATED --platform-verifier: 0 for a quote laid out by tdx_quote_v4, unsigned."""
    with open(path, "rb") as f:
        quote = f.read()
    if quote[:8] != struct.pack("<HHI", 4, 2, 0x81) or quote[636:] != UNSIGNED:
        print("SIMULATED signature check: not a quote of the simulated platform", file=sys.stderr)
        return 1
    print("SIMULATED signature check: a quote of attest/fake_tdx.py, signed by nobody; this proves nothing")
    return 0


class FakeTdx:
    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.rtmr_path = root / "rtmr3:sha384"
        self.report_dir = root / "tsm" / "report"
        self.launch_dir = root / "run"  # the guest-memory directory the launcher copies into
        self.launch_dir.mkdir(parents=True, exist_ok=True)
        self.report_dir.mkdir(parents=True)
        self._scratch = root / "platform"  # where answers are written before they are moved in
        self._scratch.mkdir()
        self.rtmr3 = bytes(48)
        self.writes: list[bytes] = []
        os.mkfifo(self.rtmr_path)
        # Held open for reading, so that a writer's open never blocks and reads never do.
        self._register_fd = os.open(self.rtmr_path, os.O_RDONLY | os.O_NONBLOCK)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._register, self._tsm)]
        for thread in self._threads:
            thread.start()

    def env(self) -> dict[str, str]:
        return {
            "TINYGW_RTMR_PATH": str(self.rtmr_path),
            "TINYGW_TSM_REPORT_DIR": str(self.report_dir),
            "TINYGW_LAUNCH_DIR": str(self.launch_dir),
        }

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        os.close(self._register_fd)

    def _register(self) -> None:
        pending = b""
        while not self._stop.is_set():
            try:
                pending += os.read(self._register_fd, 4096)
            except BlockingIOError:
                pass
            while len(pending) >= 48:
                digest, pending = pending[:48], pending[48:]
                self.rtmr3 = hashlib.sha384(self.rtmr3 + digest).digest()
                self.writes.append(digest)
            time.sleep(0.005)

    def _tsm(self) -> None:
        answer_reports(self.report_dir, self._scratch, self._stop, self._answer)

    def _answer(self, inblob: bytes) -> dict[str, bytes]:
        return {"generation": b"1\n", "provider": b"tdx_guest\n", "outblob": tdx_quote_v4(self.rtmr3, inblob)}


def answer_reports(
    report_dir: Path, scratch: Path, stop: threading.Event, answer: Callable[[bytes], dict[str, bytes]]
) -> None:
    """Until `stop`, answer each new entry of a configfs-tsm report directory once its 64-byte
    `inblob` is there: `answer(inblob)` gives the files to write, in order (`outblob` last), each
    moved in whole from `scratch` as the kernel's appear (shared with attest/fake_snp.py)."""
    answered: set[str] = set()
    while not stop.is_set():
        for entry in report_dir.iterdir():
            if entry.name in answered:
                continue
            try:
                inblob = (entry / "inblob").read_bytes()
                if len(inblob) == 64:
                    for name, content in answer(inblob).items():
                        spare = scratch / uuid.uuid4().hex
                        spare.write_bytes(content)
                        os.replace(spare, entry / name)
                    answered.add(entry.name)
            except OSError:  # not written yet, or already removed by the gateway
                pass
        time.sleep(0.005)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: attest/fake_tdx.py QUOTE (the SIMULATED signature check)")
    sys.exit(simulated_signature_check(sys.argv[1]))
