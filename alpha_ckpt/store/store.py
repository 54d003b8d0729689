"""The Store: a content-addressed store of objects and refs under one root (see :mod:`alpha_ckpt.store`)."""
from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
import time
from typing import Callable, Iterator, Sequence

from .. import durable
from ..errors import DurableWriteError, PublishConflict, Refusal, RefusalCode, StoreUsageError
from ..format import CapturePrefix, check_name, is_digest
from ._posix import _DIR_FLAGS, _check_plain_dir, _entry_kind, _file_key, _log, _plain_subdirs, write_all
from . import layout as L
from .layout import StoreLayout, fan_of, ref_name
from .objects import FAN_NAME_RE, ObjectFile, Validate
from .pending import PublishLease, _LeaseBook
from .refs import (MAX_REF_BYTES, REF_NAME_RE, History, RefRecord, UnreadableRef, check_fence,
                   decode_ref, encode_ref)
from .write_mode import DEFAULT_WRITE_MODE, DEFAULT_WRITE_THREADS, WriteModes, check_write_threads

QUARANTINE_DIR = L.QUARANTINE


class Store:
    """A store rooted at ``root`` (created if missing).

    ``write_mode``: how large objects are written, "buffered" (the default), "direct" (O_DIRECT) or
    "auto" (by measurement), or a :class:`WriteModes` learner to share with other stores on the same
    file system; the store's learner is :attr:`write_modes`. ``write_threads``: how many files of one
    batch (a save's shards) are written at once.
    """

    def __init__(self, root: str | os.PathLike, *, create: bool = True,
                 write_mode: str | WriteModes = DEFAULT_WRITE_MODE, write_threads: int = DEFAULT_WRITE_THREADS):
        self.layout = StoreLayout(root)
        self.root = self.layout.root
        self.objects_opened = 0  # objects opened for reading: tests prove a restore reads only its path
        self.bytes_written = 0   # bytes of objects this handle created (a deduplicated object adds none)
        self.write_modes = write_mode if isinstance(write_mode, WriteModes) else WriteModes(write_mode)
        self.write_threads = check_write_threads(write_threads)
        if create:
            os.makedirs(self.root, exist_ok=True)
        try:
            # The root is the user's path and may be a symlink; nothing below it may.
            self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise StoreUsageError(f"store {self.root!r} does not exist") from None
        if create:
            durable.make_dirs_durable(self._root_fd, L.CREATED)
            for name in (L.REFS, L.OUTPUTS, L.PENDING):  # objects/ and tmp/ are opened just below
                _check_plain_dir(self._root_fd, name)
        self._objects_fd = self._open_dir(self._root_fd, L.OBJECTS)
        self._tmp_fd = self._open_dir(self._root_fd, L.TMP) if create or self._exists(L.TMP) else -1
        self._fan_fds: dict[str, int] = {}
        self._fan_lock = threading.Lock()
        self._fans_to_sync = False
        self._quarantine_fd = -1
        self._leases = _LeaseBook(self._root_fd)
        # (st_dev, st_ino, st_size) of objects this handle committed or read back in full: an existing
        # object that matches is reused without reading it again (its file is read-only since its commit).
        self._known_intact: set[tuple[int, int, int]] = set()

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self._root_fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def _open_dir(self, parent: int, name: str) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            raise StoreUsageError(f"{self.root!r} is not an alpha_ckpt store (no {name}/)") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Refusal(RefusalCode.FORMAT, f"store entry {name!r} is not a plain directory") from None
            raise

    def close(self) -> None:
        self._leases.close()
        for fd in [self._root_fd, self._objects_fd, self._tmp_fd, self._quarantine_fd, *self._fan_fds.values()]:
            if fd >= 0:
                os.close(fd)
        self._fan_fds.clear()
        self._root_fd = self._objects_fd = self._tmp_fd = self._quarantine_fd = -1

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # A handle dropped without close() gives its directory descriptors back: a long job that
        # opens a store per save would otherwise run out of them.
        if hasattr(self, "_leases"):  # not when __init__ failed before opening everything
            self.close()

    # ------------------------------------------------------------ objects

    def _fan_dir(self, digest: str, create: bool) -> int:
        fan = fan_of(digest)
        with self._fan_lock:
            fd = self._fan_fds.get(fan)
            if fd is None:
                if create:
                    try:
                        os.mkdir(fan, 0o755, dir_fd=self._objects_fd)
                    except FileExistsError:
                        pass
                    # objects/ is fsynced once for every fan this handle first used in a batch
                    # (see _sync_new_fans), not once per fan; even for one that existed, as an
                    # earlier process may have died between its mkdir and its fsync.
                    self._fans_to_sync = True
                fd = os.open(fan, _DIR_FLAGS, dir_fd=self._objects_fd)
                self._fan_fds[fan] = fd
            return fd

    def _sync_new_fans(self) -> None:
        """fsync objects/ if a fan directory was first used since the last time: before an object in
        it is reported durable, its fan's own name is."""
        with self._fan_lock:
            if self._fans_to_sync:
                try:
                    os.fsync(self._objects_fd)
                except OSError as exc:
                    raise DurableWriteError("dir-fsync", exc.errno or errno.EIO, f"objects/: {exc}") from exc
                self._fans_to_sync = False

    def has_object(self, digest: str) -> bool:
        self.check_digest(digest)
        try:
            st = os.stat(f"{fan_of(digest)}/{digest}", dir_fd=self._objects_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode)

    def put_object(self, write: Callable[[int], str], digest_hint: str | None = None, *,
                   validate: Validate) -> tuple[str, bool]:
        """Durably write an object; ``write(fd)`` writes it and returns its digest.

        Returns (digest, written). An object that already exists is not written
        again (same name, same content): that is the dedup. It is reused only
        once it is known intact (see :meth:`_reusable`): ``validate(obj, what)``
        checks an existing file's content against its name, raising a Refusal
        if it does not match (the store knows names, not what objects hold:
        :func:`alpha_ckpt.restore.validate_object_file` does). Anything else found
        under the name is set aside into ``quarantine/`` and the object
        committed anew. A reused object's modification time is renewed, so
        gc's grace period protects it until the publish reusing it has its ref.
        """
        if digest_hint is not None and self._reusable(self.check_digest(digest_hint), None, validate):
            self._sync_new_fans()
            return digest_hint, False
        return self.put_objects([write], validate=validate)[0]

    def put_objects(self, writes: Sequence[Callable[[int], str]], *, validate: Validate) -> list[tuple[str, bool]]:
        """Durably write several objects as :meth:`put_object` does, in one batched durable commit.

        Every object is written before any is fsynced (see
        :func:`alpha_ckpt.durable.durable_commit_all`), so the disk streams the
        batch and each directory is fsynced once; :attr:`write_threads` of them are
        written at once. Returns (digest, written) per write, in order.
        """
        results: list[tuple[str, bool] | None] = [None] * len(writes)
        left = list(range(len(writes)))
        for _ in range(3):  # again only if the existing copy was set aside or removed (gc) in between
            names: dict[int, str] = {}
            files: dict[int, os.stat_result] = {}

            def named(i: int) -> Callable[[int], str]:
                def write_named(fd: int) -> str:
                    names[i] = self.check_digest(writes[i](fd))
                    files[i] = os.fstat(fd)  # the same inode once renamed into place
                    return names[i]
                return write_named

            # The fan directory depends on the digest, known only once written.
            outcomes = durable.durable_commit_all(self._tmp_fd, [
                durable.Commit(named(i), lambda name: self._fan_dir(name, create=True)) for i in left],
                self.write_threads)
            again = []
            for i, outcome in zip(left, outcomes):
                if isinstance(outcome, FileExistsError):
                    if self._reusable(names[i], files[i].st_size, validate):
                        results[i] = (names[i], False)
                    else:
                        again.append(i)
                    continue
                self.bytes_written += files[i].st_size
                self._known_intact.add(_file_key(files[i]))
                results[i] = (outcome, True)
            left = again
            if not left:
                self._sync_new_fans()
                return results  # type: ignore[return-value]
        raise DurableWriteError("rename", errno.EEXIST, f"object {names[left[0]]} kept disappearing while being reused")

    def _reusable(self, digest: str, size: int | None, validate: Validate) -> bool:
        """Whether the entry named ``digest`` may stand for the object being written; renews it if so.

        It may when it is a regular file (never followed through a symlink,
        never opened blocking) of the object's size (``size``, where known)
        whose content validates against its name: the head hashes to the name
        and every slice to the digest the head records, so it holds exactly the
        bytes being written. Anything else is set aside into quarantine/ and
        False returned (False too when the name is gone), so the caller commits
        its own copy. An object this handle committed or checked before is
        trusted on its (device, inode, size).
        """
        fan = self._fan_dir(digest, create=True)
        try:
            st = os.stat(digest, dir_fd=fan, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size) and _file_key(st) in self._known_intact:
            return self._renew(digest)
        problem = self._damage(fan, digest, st, size, validate)
        if problem is None:
            self._known_intact.add(_file_key(st))
            return self._renew(digest)
        if problem:
            self._quarantine(fan, digest, st, problem)
        return False

    def _damage(self, fan: int, digest: str, st: os.stat_result, size: int | None, validate: Validate) -> str | None:
        """What is wrong with the entry ``st`` found under ``digest``: None if intact, "" if it changed meanwhile."""
        if not stat.S_ISREG(st.st_mode):
            return f"a {durable.file_kind(st.st_mode)}, not a regular file"
        if size is not None and st.st_size != size:
            return f"{st.st_size} bytes where the object has {size}"
        try:
            fd = os.open(digest, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fan)
        except FileNotFoundError:
            return ""
        except OSError as exc:
            return f"cannot be opened ({exc.strerror})"
        try:
            opened = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(opened.st_mode):
            os.close(fd)
            return ""
        with ObjectFile(fd, opened.st_size, digest) as obj:
            try:
                validate(obj, f"existing object {digest[:16]}...")
            except Refusal as refusal:
                return refusal.message
        return None

    def _quarantine(self, fan: int, digest: str, st: os.stat_result, problem: str) -> None:
        """Durably rename a damaged or hostile entry aside (never delete it: it is evidence); gc sweeps it later."""
        try:  # another writer may have set it aside and committed a good copy meanwhile: leave that one
            now = os.stat(digest, dir_fd=fan, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return
        name = f"{digest}-{int(time.time())}-{secrets.token_hex(4)}"
        if not self._move_to_quarantine(fan, digest, name, f"object {digest}"):
            return
        _log(f"alpha_ckpt: store {self.root}: object {digest} was not reused: {problem}; "
             f"set aside as {QUARANTINE_DIR}/{name}, written again\n")

    def _move_to_quarantine(self, dir_fd: int, name: str, aside: str, what: str) -> bool:
        """Durably rename ``name`` in ``dir_fd`` to ``quarantine/aside`` (False: it was gone already).

        A fresh random name: a plain rename cannot replace anything, and it moves a directory too.
        """
        if self._quarantine_fd < 0:
            self._quarantine_fd = durable.make_dir_durable(self._root_fd, QUARANTINE_DIR)
        try:
            os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=self._quarantine_fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise DurableWriteError("quarantine", exc.errno or errno.EIO, f"setting aside {what}: {exc}") from exc
        try:
            durable.fsync_dir(self._quarantine_fd)
            durable.fsync_dir(dir_fd)
        except OSError as exc:
            raise DurableWriteError("dir-fsync", exc.errno or errno.EIO, f"setting aside {what}: {exc}") from exc
        return True

    def renew_object(self, digest: str) -> bool:
        """Renew an object's modification time (False if it is gone): gc then counts it as young."""
        return self._renew(self.check_digest(digest))

    def _renew(self, digest: str) -> bool:
        """Touch a reused object (False if it is gone): gc spares objects younger than its grace period."""
        try:
            os.utime(f"{fan_of(digest)}/{digest}", dir_fd=self._objects_fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    @staticmethod
    def check_digest(digest: object) -> str:
        if not is_digest(digest):
            raise Refusal(RefusalCode.FORMAT, f"object name {digest!r} is not a plain 64-hex digest")
        return digest  # type: ignore[return-value]

    def open_object(self, digest: str, what: str) -> ObjectFile:
        """Open an object for reading: a regular file, never through a symlink."""
        self.check_digest(digest)
        self.objects_opened += 1
        try:
            fan = self._fan_dir(digest, create=False)
            fd = os.open(digest, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fan)
        except FileNotFoundError:
            raise Refusal(RefusalCode.MISSING_SHARD, f"{what} {digest} is missing from the store") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Refusal(RefusalCode.FORMAT, f"{what} {digest} is a symlink or not a regular file") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise Refusal(RefusalCode.FORMAT, f"{what} {digest} is not a regular file")
        return ObjectFile(fd, st.st_size, digest)

    def object_path(self, digest: str) -> str:
        self.check_digest(digest)
        return self.layout.object_path(digest)

    def iter_objects(self, on_hostile: Callable[[str, str], None] | None = None) -> Iterator[str]:
        """Every object's name, in order: regular files named by their digest in their fan directory.

        Anything else under objects/ (a fan that is a symlink or a file, a
        FIFO, directory or symlink under an object's name, a foreign name) is
        no object of this store: it is skipped, and ``on_hostile(path, why)``
        hears of it. Nothing is followed through a symlink.
        """
        report = on_hostile or (lambda path, why: None)
        for fan in sorted(os.listdir(self._objects_fd)):
            kind = _entry_kind(self._objects_fd, fan)
            if kind is None:
                continue  # gone meanwhile
            if not (kind == "directory" and FAN_NAME_RE.match(fan)):
                report(f"objects/{fan}", f"a {kind}, not a fan directory of objects")
                continue
            try:
                fan_fd = os.open(fan, _DIR_FLAGS, dir_fd=self._objects_fd)
            except OSError:
                continue  # replaced meanwhile
            try:
                names = []
                for name in sorted(os.listdir(fan_fd)):
                    kind = _entry_kind(fan_fd, name)
                    if kind is None:
                        continue
                    if not (is_digest(name) and name.startswith(fan)):
                        report(f"objects/{fan}/{name}", f"a {kind} whose name is not an object's")
                    elif kind != "regular file":
                        report(f"objects/{fan}/{name}", f"a {kind}, not an object file")
                    else:
                        names.append(name)
            finally:
                os.close(fan_fd)
            yield from names

    # ------------------------------------------------------------ pending publishes

    def pending_publish(self, run: str, step: str) -> "PublishLease":
        """Take a lease for a publish of (run, step) about to write objects; release it once the ref is out.

        ``with store.pending_publish(run, step): ...write objects, publish the ref...``. While it is held,
        gc removes no object modified after the lease started. Overlapping publishes of one process share
        one lease file.
        """
        check_name(run, "run")
        check_name(step, "step")
        return self._leases.acquire(run, step)

    # ------------------------------------------------------------ refs

    def _refs_dir(self, run: str, step: str, create: bool) -> int | None:
        check_name(run, "run")
        check_name(step, "step")
        try:
            refs = os.open(L.REFS, _DIR_FLAGS, dir_fd=self._root_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._not_a_directory(L.REFS, exc)
        try:
            if create:
                run_fd = durable.make_dir_durable(refs, run)
                try:
                    return durable.make_dir_durable(run_fd, step)
                finally:
                    os.close(run_fd)
            try:
                run_fd = os.open(run, _DIR_FLAGS, dir_fd=refs)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise self._not_a_directory(f"refs/{run}", exc)
            try:
                return os.open(step, _DIR_FLAGS, dir_fd=run_fd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise self._not_a_directory(f"refs/{run}/{step}", exc)
            finally:
                os.close(run_fd)
        finally:
            os.close(refs)

    @staticmethod
    def _not_a_directory(path: str, exc: OSError) -> Exception:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return Refusal(RefusalCode.FORMAT, f"store entry {path} is a symlink or not a directory")
        return exc

    def publish_ref(self, prefix: CapturePrefix, root: str, root_size: int, total_bytes: int, owners: int, *,
                    follows: int | None = None) -> RefRecord:
        """Publish the next generation of (run, step): a NOREPLACE ref naming ``root``, if the history allows it.

        History fencing (:func:`check_fence`): the refs are read from the
        newest down to the newest readable one (:meth:`history`), and a publish
        whose epoch is older than the newest generation's is refused
        (``stale-epoch``); with ``follows`` (the highest generation number this
        publisher has seen in its history, 0 for an empty history), a history
        that has taken a number since is refused too (``fenced``) when that
        generation is of the same epoch or cannot be read. The ref then takes
        the number after the highest one taken (an unreadable ref's number is
        never reused) with NOREPLACE, so the check is race-free: a publisher
        that lost the number re-reads the newest ref and is fenced, or gets
        :class:`PublishConflict` (retryable) when the winner was not one to
        fence it. Publishing the root the newest ref already names returns that
        ref (a retried save is idempotent). Unreadable refs passed over are
        named on stderr.
        """
        dir_fd = self._refs_dir(prefix.run, prefix.step, create=True)
        try:
            history = self._history(dir_fd, prefix.run, prefix.step, whole=False)
            newest = history.newest
            if newest is not None and newest.generation == history.top \
                    and (newest.root, newest.prefix) == (root, prefix):
                return newest  # this very state is already the newest generation (a retried save): nothing to add
            check_fence(history, prefix, follows)
            generation = history.top + 1
            record = RefRecord(prefix.run, prefix.step, generation, root, root_size, prefix, time.time(), total_bytes, owners)
            try:
                self._put_ref(dir_fd, record)
            except FileExistsError:
                winner = self._read_ref(dir_fd, prefix.run, prefix.step, generation)
                if isinstance(winner, RefRecord):  # it may fence this publish: say so precisely
                    check_fence(History(prefix.run, prefix.step, (winner,), generation), prefix, follows)
                raise PublishConflict(f"generation {generation} of {prefix.run}/{prefix.step} was published by another publisher") from None
            for bad in history.unreadable_above:
                _log(f"alpha_ckpt: store {self.root}: ref {bad.name} cannot be read and was passed over: "
                     f"{bad.refusal}; generation {generation} follows "
                     f"{'generation ' + str(newest.generation) if newest else 'no readable generation'}\n")
            return record
        finally:
            os.close(dir_fd)

    def put_ref(self, record: RefRecord) -> None:
        """Durably write ``record`` as generation ``record.generation`` of its run and step if that number is
        free (FileExistsError if not). The storage step under :meth:`publish_ref`, with no history check:
        only :meth:`publish_ref` publishes a generation that follows its history."""
        dir_fd = self._refs_dir(record.run, record.step, create=True)
        try:
            self._put_ref(dir_fd, record)
        finally:
            os.close(dir_fd)

    def _put_ref(self, dir_fd: int, record: RefRecord) -> None:
        body = encode_ref(record)
        name = ref_name(record.generation)
        # The last line of defence: never write a ref that this store's readers would refuse (it
        # would stand as the newest generation and refuse every later publish and restore).
        decode_ref(body, f"ref {record.run}/{record.step}/{name} (not written)")

        def write(fd: int) -> None:
            write_all(fd, body)

        durable.durable_commit(tmp_dir=self._tmp_fd, dest_dir=dir_fd, write=write, name=name, kind="ref")

    @staticmethod
    def _ref_numbers(dir_fd: int) -> list[int]:
        out = []
        for name in os.listdir(dir_fd):
            if REF_NAME_RE.match(name):
                out.append(int(name))
        return sorted(out)

    def history(self, run: str, step: str, *, whole: bool = True) -> History:
        """The refs of (run, step) (see :class:`History`): every one, or with ``whole=False`` only those from
        the newest readable one up (one listing, and usually one ref read)."""
        dir_fd = self._refs_dir(run, step, create=False)
        if dir_fd is None:
            return History(run, step, (), 0)
        try:
            return self._history(dir_fd, run, step, whole)
        finally:
            os.close(dir_fd)

    def _history(self, dir_fd: int, run: str, step: str, whole: bool) -> History:
        numbers = self._ref_numbers(dir_fd)
        entries = []
        for generation in reversed(numbers):
            entry = self._read_ref_entry(dir_fd, run, step, generation)
            if entry is None:
                continue  # removed since the listing (gc): no generation, but its number was taken
            entries.append(entry)
            if not whole and isinstance(entry, RefRecord):
                break
        return History(run, step, tuple(reversed(entries)), numbers[-1] if numbers else 0)

    def list_refs(self, run: str, step: str) -> list[RefRecord | Refusal]:
        """Every generation of (run, step), oldest first; unreadable refs are returned as refusals."""
        return self.history(run, step).listing()

    def _read_ref(self, dir_fd: int, run: str, step: str, generation: int) -> RefRecord | Refusal:
        entry = self._read_ref_entry(dir_fd, run, step, generation)
        if entry is None:
            return Refusal(RefusalCode.FORMAT, f"ref {run}/{step}/{ref_name(generation)}: cannot open (gone)")
        return entry if isinstance(entry, RefRecord) else entry.refusal

    def _read_ref_entry(self, dir_fd: int, run: str, step: str, generation: int) -> RefRecord | UnreadableRef | None:
        """The ref ``generation``: its record, why it cannot be read, or None where it is gone.

        The entry's type is read first (lstat), so a FIFO is never opened, a
        symlink never followed, a directory never read."""
        name = ref_name(generation)
        what = f"ref {run}/{step}/{name}"

        def unreadable(code: RefusalCode, why: str, damaged: bool = True) -> UnreadableRef:
            return UnreadableRef(run, step, generation, Refusal(code, f"{what}: {why}"), damaged)

        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return unreadable(RefusalCode.FORMAT, f"cannot be examined ({exc.strerror})", False)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REF_BYTES:
            return unreadable(RefusalCode.FORMAT, f"a {durable.file_kind(st.st_mode)} of {st.st_size} bytes, not a "
                              f"ref file (a regular file of at most {MAX_REF_BYTES} bytes)")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return unreadable(RefusalCode.FORMAT, f"cannot open ({exc.strerror})", exc.errno == errno.ELOOP)
        try:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode) or opened.st_size > MAX_REF_BYTES:  # replaced since the lstat
                return unreadable(RefusalCode.FORMAT, f"not a regular file of at most {MAX_REF_BYTES} bytes")
            data = os.pread(fd, MAX_REF_BYTES, 0)
        except OSError as exc:
            return unreadable(RefusalCode.FORMAT, f"cannot be read ({exc.strerror})", False)
        finally:
            os.close(fd)
        try:
            record = decode_ref(data, what)
        except Refusal as refusal:
            return UnreadableRef(run, step, generation, refusal, True)
        if (record.run, record.step, record.generation) != (run, step, generation):
            return unreadable(RefusalCode.FORMAT, f"names generation {record.run}/{record.step}/{record.generation}")
        return record

    def newest_ref(self, run: str, step: str) -> RefRecord | None:
        """The newest readable generation of (run, step) (see :meth:`history`), or None."""
        return self.history(run, step, whole=False).newest

    def set_aside_ref(self, run: str, step: str, generation: int) -> str | None:
        """Move the unreadable ref ``generation`` into ``quarantine/`` (gc): the name it got there, or None.

        Only a ref that is damaged for good (:attr:`UnreadableRef.damaged`,
        read again now) and not the newest number taken is moved: a newer ref
        keeps the numbering past it, so its number is never reused. Renamed,
        never deleted (it is evidence); gc sweeps it after the grace period.
        """
        dir_fd = self._refs_dir(run, step, create=False)
        if dir_fd is None:
            return None
        try:
            entry = self._read_ref_entry(dir_fd, run, step, generation)
            numbers = self._ref_numbers(dir_fd)
            if not (isinstance(entry, UnreadableRef) and entry.damaged and numbers and numbers[-1] > generation):
                return None
            # Run and step names are long enough to overflow a name: the log line says where it came from.
            aside = f"ref-{ref_name(generation)}-{int(time.time())}-{secrets.token_hex(4)}"
            if not self._move_to_quarantine(dir_fd, ref_name(generation), aside, entry.name):
                return None
        finally:
            os.close(dir_fd)
        _log(f"alpha_ckpt: store {self.root}: ref {entry.name} cannot be read: {entry.refusal}; "
             f"set aside as {QUARANTINE_DIR}/{aside}\n")
        return aside

    def find_ref(self, root: str) -> RefRecord | None:
        """The first ref (any run/step) that names ``root``, or None."""
        for run, step in self.runs():
            for record in self.list_refs(run, step):
                if isinstance(record, RefRecord) and record.root == root:
                    return record
        return None

    def runs(self) -> list[tuple[str, str]]:
        """Every (run, step) with a refs directory; symlinks and odd names are skipped."""
        out = []
        try:
            refs = os.open(L.REFS, _DIR_FLAGS, dir_fd=self._root_fd)
        except FileNotFoundError:
            return out
        except OSError as exc:
            raise self._not_a_directory(L.REFS, exc)
        try:
            for run in sorted(_plain_subdirs(refs)):
                run_fd = os.open(run, _DIR_FLAGS, dir_fd=refs)
                try:
                    out.extend((run, step) for step in sorted(_plain_subdirs(run_fd)))
                finally:
                    os.close(run_fd)
        finally:
            os.close(refs)
        return out

