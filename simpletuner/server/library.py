"""Dataset folders the web UI manages: uploads (images, caption .txt files, videos, zips of them) written into a
dataset's folder, captions edited in place, images removed. Torch-free and without an image library: a file's
type is judged by its first bytes (an image's header must also give its size, see
:func:`simpletuner.config.scan.image_size`), never by its name or the browser's content type.

Every name that comes from a user (an upload's file name, a zip member, a path in a URL) becomes a relative path
of safe components, and what it resolves to must lie inside the dataset folder; files are written to a temporary
name in the target folder and renamed into place, so a failed upload leaves nothing half-written.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from simpletuner.config.buckets import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from simpletuner.config.files import write_text_atomic
from simpletuner.config.scan import image_size

CAPTION_EXT = ".txt"
MAX_CAPTION_BYTES = 64 * 1024
MAX_DEPTH = 8  # sub-folders a zip may nest
MAX_ZIP_MEMBERS = 20_000
_SAFE = re.compile(r"[^A-Za-z0-9._ -]+")


class UploadRefused(ValueError):
    """A file (or a zip member) that is not taken, and why."""


@dataclass
class UploadResult:
    saved: list[str] = field(default_factory=list)  # paths relative to the dataset folder
    skipped: list[dict] = field(default_factory=list)  # {"name", "reason"}


def safe_relpath(name: str) -> str:
    """A user-supplied file name or path as a safe relative POSIX path (``a/b.png``): separators normalised, each
    component stripped of odd characters, no empty, ``.``, ``..`` or hidden components. UploadRefused when nothing
    usable is left."""
    parts = []
    for part in PurePosixPath(name.replace("\\", "/")).parts:
        if part in ("/", ".", ".."):
            if part == "..":
                raise UploadRefused(f"{name!r}: a path with '..' is refused")
            continue
        clean = _SAFE.sub("_", part).strip(" .")
        if not clean:
            raise UploadRefused(f"{name!r}: not a usable file name")
        parts.append(clean[:200])
    if not parts:
        raise UploadRefused(f"{name!r}: not a usable file name")
    if len(parts) > MAX_DEPTH + 1:
        raise UploadRefused(f"{name!r}: nested deeper than {MAX_DEPTH} folders")
    return "/".join(parts)


def inside(root: Path, relpath: str) -> Path:
    """``root / relpath`` when it resolves (symlinks followed) inside ``root``; UploadRefused otherwise."""
    real_root = Path(os.path.realpath(root))
    target = Path(os.path.realpath(real_root / relpath))
    if target == real_root or real_root not in target.parents:
        raise UploadRefused(f"{relpath!r}: resolves outside the dataset folder")
    return target


def _video_kind(head: bytes) -> bool:
    return head[4:8] == b"ftyp" or head[:4] == b"\x1a\x45\xdf\xa3" or (head[:4] == b"RIFF" and head[8:12] == b"AVI ")


def check_content(relpath: str, head: bytes, path: Path | None = None) -> str:
    """What the file is by its content: "image", "video" or "caption"; UploadRefused when its first bytes do not
    match what its name says (or it is none of those). ``path``: the file on disk, to read an image's size."""
    ext = PurePosixPath(relpath).suffix.lower()
    if ext in IMAGE_EXTENSIONS:
        if path is None or image_size(path) is None:
            raise UploadRefused(f"{relpath}: not a readable {ext[1:].upper()} image (the content does not match the "
                                "name)")
        return "image"
    if ext in VIDEO_EXTENSIONS:
        if not _video_kind(head):
            raise UploadRefused(f"{relpath}: not a video file (the content does not match the name)")
        return "video"
    if ext == CAPTION_EXT:
        if path is not None and path.stat().st_size > MAX_CAPTION_BYTES:
            raise UploadRefused(f"{relpath}: a caption file larger than {MAX_CAPTION_BYTES} bytes")
        data = path.read_bytes() if path is not None else head
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise UploadRefused(f"{relpath}: a caption file must be UTF-8 text") from None
        if "\x00" in text:
            raise UploadRefused(f"{relpath}: a caption file must be text")
        return "caption"
    kinds = " ".join(sorted(IMAGE_EXTENSIONS | VIDEO_EXTENSIONS | {CAPTION_EXT, ".zip"}))
    raise UploadRefused(f"{relpath}: not a dataset file (takes {kinds})")


def _store(root: Path, relpath: str, source: BinaryIO, max_bytes: int) -> str:
    """Copy ``source`` (at most ``max_bytes``) to ``root/relpath``: into a temporary file in the target folder,
    checked by content, then renamed into place (an existing file of that name is replaced)."""
    target = inside(root, relpath)
    target.parent.mkdir(parents=True, exist_ok=True)
    target = inside(root, relpath)  # again, now that its folders exist
    fd, tmp_name = tempfile.mkstemp(prefix=".upload-", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        size = 0
        head = b""
        with os.fdopen(fd, "wb") as out:
            while chunk := source.read(1024 * 1024):
                size += len(chunk)
                if size > max_bytes:
                    raise UploadRefused(f"{relpath}: larger than the {max_bytes // (1024 * 1024)} MiB a file may be")
                if len(head) < 64:
                    head += chunk[:64 - len(head)]
                out.write(chunk)
        check_content(relpath, head, tmp)
        if target.is_symlink():
            raise UploadRefused(f"{relpath}: is a link; not replaced")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return relpath


def _zip_members(archive: zipfile.ZipFile, max_total: int):
    """(relpath, info) of a zip's files, refusing links, oversized or too many members (zip bombs)."""
    infos = [i for i in archive.infolist() if not i.is_dir()]
    if len(infos) > MAX_ZIP_MEMBERS:
        raise UploadRefused(f"the zip has {len(infos)} files; at most {MAX_ZIP_MEMBERS} are taken")
    total = sum(i.file_size for i in infos)
    if total > max_total:
        raise UploadRefused(f"the zip unpacks to {total} bytes, more than the {max_total} bytes allowed")
    for info in infos:
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            yield info.filename, None, "a link inside the zip is refused"
            continue
        name = info.filename
        if PurePosixPath(name).name.startswith((".", "__MACOSX")) or name.startswith("__MACOSX/"):
            continue  # Finder's and editors' hidden files
        yield name, info, None


def save_upload(root: Path, filename: str, source: BinaryIO, *, max_bytes: int, max_zip_bytes: int,
                result: UploadResult | None = None) -> UploadResult:
    """Save one uploaded file into the dataset folder ``root``: an image, video or caption file, or a zip holding
    them (unpacked, sub-folders kept). Refused files are listed in ``result.skipped`` with the reason."""
    result = result or UploadResult()
    try:
        relpath = safe_relpath(filename)
    except UploadRefused as exc:
        result.skipped.append({"name": filename, "reason": str(exc)})
        return result
    if PurePosixPath(relpath).suffix.lower() != ".zip":
        try:
            result.saved.append(_store(root, relpath, source, max_bytes))
        except UploadRefused as exc:
            result.skipped.append({"name": filename, "reason": str(exc)})
        return result
    with tempfile.TemporaryFile() as spooled:  # zipfile needs to seek
        shutil.copyfileobj(source, spooled, 1024 * 1024)
        spooled.seek(0)
        try:
            archive = zipfile.ZipFile(spooled)
        except zipfile.BadZipFile:
            result.skipped.append({"name": filename, "reason": f"{relpath}: not a zip file"})
            return result
        with archive:
            try:
                members = list(_zip_members(archive, max_zip_bytes))
            except UploadRefused as exc:
                result.skipped.append({"name": filename, "reason": f"{relpath}: {exc}"})
                return result
            for name, info, refused in members:
                where = f"{filename}:{name}"
                if refused:
                    result.skipped.append({"name": where, "reason": refused})
                    continue
                try:
                    member = safe_relpath(name)
                    with archive.open(info) as fh:
                        result.saved.append(_store(root, member, fh, max_bytes))
                except (UploadRefused, zipfile.BadZipFile, RuntimeError, EOFError) as exc:
                    result.skipped.append({"name": where, "reason": str(exc)})
    return result


def write_caption(root: Path, image: str, caption: str) -> str:
    """Write ``caption`` as the .txt beside the dataset image ``image`` (atomically); returns the .txt's path."""
    relpath = safe_relpath(image)
    target = inside(root, relpath)
    if not target.is_file() or target.suffix.lower() not in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS:
        raise FileNotFoundError(relpath)
    data = caption.encode("utf-8")
    if len(data) > MAX_CAPTION_BYTES:
        raise UploadRefused(f"caption: longer than {MAX_CAPTION_BYTES} bytes")
    txt = target.with_suffix(CAPTION_EXT)
    if txt.is_symlink():
        raise UploadRefused(f"{relpath}: its caption file is a link; not replaced")
    write_text_atomic(txt, caption.strip() + "\n")
    return str(PurePosixPath(relpath).with_suffix(CAPTION_EXT))


def remove_file(root: Path, image: str) -> list[str]:
    """Delete a dataset image (or video) and its caption file; returns what was removed."""
    relpath = safe_relpath(image)
    target = inside(root, relpath)
    if not target.is_file() or target.suffix.lower() not in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS:
        raise FileNotFoundError(relpath)
    removed = [relpath]
    target.unlink()
    txt = target.with_suffix(CAPTION_EXT)
    if txt.is_file():
        txt.unlink()
        removed.append(str(PurePosixPath(relpath).with_suffix(CAPTION_EXT)))
    return removed


def read_caption(path: Path) -> str | None:
    """The caption file beside ``path`` (None when there is none)."""
    txt = path.with_suffix(CAPTION_EXT)
    try:
        return txt.read_text(encoding="utf-8", errors="replace").strip()
    except (FileNotFoundError, IsADirectoryError):
        return None
