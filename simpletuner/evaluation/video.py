"""Writing validation videos: H.264 mp4 through PyAV (FFmpeg's libraries, in its wheel; see simpletuner/data/video.py
for why PyAV)."""

from __future__ import annotations

from pathlib import Path


def write_mp4(path: str | Path, frames, fps: float) -> None:
    """Write RGB frames (PIL images or HxWx3 uint8 arrays) as an H.264 mp4, atomically (temp file + rename)."""
    import os
    import tempfile

    import av
    import numpy as np

    path = Path(path)
    arrays = [np.asarray(f.convert("RGB") if hasattr(f, "convert") else f, dtype=np.uint8) for f in frames]
    height, width = arrays[0].shape[:2]
    # yuv420p needs even sizes; pad by repeating the last row/column
    pad_h, pad_w = height % 2, width % 2
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".mp4", dir=path.parent)
    os.close(fd)
    try:
        with av.open(tmp, mode="w", format="mp4") as container:
            from fractions import Fraction

            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
            stream.width, stream.height, stream.pix_fmt = width + pad_w, height + pad_h, "yuv420p"
            stream.options = {"crf": "18"}
            for arr in arrays:
                if pad_h or pad_w:
                    arr = np.pad(arr, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge")
                for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
