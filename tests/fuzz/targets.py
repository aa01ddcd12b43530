"""atheris targets: `python -m tests.fuzz.targets protocol|blob -runs=N [corpus dirs]`.

Each input is fed to a decoder; any exception but the decoder's typed error is a finding (atheris
then prints the input and exits non-zero). Run as a process: atheris.Fuzz() never returns.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from kvtier.app import protocol as p
    from kvtier.storage import codec
    from kvtier.storage.base import BlobError, ChunkKey

KEY = ChunkKey("0123456789abcdef", b"prefix-hash".ljust(32, b"."))


def protocol_input(data: bytes) -> None:
    """Feed arbitrary bytes to both frame decoders, whole and split in two."""
    for make in (p.request_decoder, p.reply_decoder):
        for cut in (len(data), len(data) // 2):
            decoder = make(max_frame=1 << 16)
            try:
                decoder.feed(data[:cut])
                decoder.feed(data[cut:])
            except p.ProtocolError:
                pass


def blob_input(data: bytes) -> None:
    """Decode arbitrary bytes as a stored chunk, and as a valid chunk's header followed by them."""
    for blob in (data, codec.encode_header(KEY, data) + data[: len(data) // 2]):
        try:
            codec.decode(blob, KEY)
        except BlobError:
            pass
        try:
            codec.parse_header(blob)
        except BlobError:
            pass


TARGETS = {"protocol": protocol_input, "blob": blob_input}


def main(argv: list[str]) -> None:
    """Run the named target under atheris with the remaining (libFuzzer) arguments."""
    target = TARGETS[argv[1]]
    atheris.Setup([argv[0], *argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
