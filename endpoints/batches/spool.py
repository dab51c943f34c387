"""A batch line's answer kept in a temporary file: one larger than a worker process keeps in memory.

A line's answer may be as large as an interactive call's (`upstream.MAX_WHOLE_BODY_BYTES`, 64 MiB), far past the share
of `BATCH_ANSWER_BYTES` one answer may hold in memory (`answer_bytes.largest_answer_bytes`). Past that share its bytes
go on to a `Spool` as they are read (`answer_bytes.LineAnswer`), and the line's row is read from the file when it is
stored (`SpooledRow`): the answer is never whole in memory, checked (`check_and_clean`) and written a piece at a time.

NOTE: the file is made with `tempfile.TemporaryFile`, unlinked as it is opened: it has no name, and its disk is the
system's again once it is closed or its process dies, however it dies. How many a process holds at once is
`answer_bytes.num_spools` (`BATCH_SPOOL_BYTES` over the largest answer).
"""

from __future__ import annotations

import codecs
import io
import json
import os
import tempfile
import threading

from endpoints.gateway import upstream

# A spooled answer is checked, and its row read, this many bytes at a time.
PIECE_BYTES = 1024 * 1024


class Spool:
    """An answer's bytes in an unnamed temporary file, at most `upstream.MAX_WHOLE_BODY_BYTES` of them: past that the
    answer is too large, as it would be outside a batch, and the file is emptied (`too_large`)."""

    __slots__ = ("file", "num_bytes", "too_large", "failed", "_has_line_ends", "_lock")

    def __init__(self) -> None:
        # NOTE: held while a worker thread reads or writes the file (`check_and_clean`, `SpooledRow`), and by `close`:
        # a run that ends on an error gives back the answers of lines still being checked or stored, and a descriptor
        # closed under them may be another file's by the time they read it (another line's answer, put to S3 as this
        # one's).
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.too_large = False
        self.failed: OSError | None = (
            None  # the disk refused the file or a write (full): the line is tried again
        )
        self._has_line_ends = False
        try:
            self.file = tempfile.TemporaryFile(prefix="inferplane-answer-")
        except (
            OSError
        ) as exc:  # NOTE: made as a read comes in (`answer_bytes`): never raised into the connection's
            self.file = None
            self.failed = exc

    @property
    def whole(self) -> bool:
        """Whether it holds the whole answer read (none of it dropped)."""
        return not self.too_large and self.failed is None

    def write(self, data: bytes) -> None:
        """More of the answer, as read (called in its run's event loop: a write to the page cache)."""
        self.num_bytes += len(data)
        if (
            not self.whole or self.file is None
        ):  # dropped, or given back (its run ended while its line still read)
            return
        if self.num_bytes > upstream.MAX_WHOLE_BODY_BYTES:
            self.too_large = True
            self._empty()
            return
        if b"\n" in data or b"\r" in data:
            self._has_line_ends = True
        try:
            self.file.write(data)
        except OSError as exc:
            self.failed = exc
            self._empty()

    def _empty(self) -> None:
        try:
            self.file.truncate(0)
        except OSError:
            pass

    def close(self) -> None:
        """Its disk given back (once the worker thread reading it, if any, is done with it)."""
        with self._lock:
            if self.file is not None:
                self.file.close()
                self.file = None

    def pread(self, num_bytes: int, offset: int) -> bytes:
        """`num_bytes` of the file from `offset` (fewer at its end); `OSError` once it was given back."""
        with self._lock:
            if self.file is None:
                raise OSError("the spooled answer was given back")
            return os.pread(self.file.fileno(), num_bytes, offset)

    def size(self) -> int:
        with self._lock:
            if self.file is None:
                raise OSError("the spooled answer was given back")
            self.file.flush()
            return os.fstat(self.file.fileno()).st_size

    def check_and_clean(self) -> bool:
        """Whether the file holds one JSON text in UTF-8, as `runner.json_text` checks an answer held in memory; its
        line ends (between its tokens) are taken out in place. Read a piece at a time (`_JsonPieces`): never whole in
        memory. Run in a worker thread: the check of 64 MiB takes a few seconds."""
        with self._lock:
            return self.file is not None and self._check_and_clean()

    def _check_and_clean(self) -> bool:
        self.file.flush()
        descriptor = self.file.fileno()
        size = os.fstat(descriptor).st_size
        decoder = codecs.getincrementaldecoder("utf-8")()
        checker = _JsonPieces()
        read_at = written_at = 0
        try:
            while read_at < size:
                piece = os.pread(descriptor, min(PIECE_BYTES, size - read_at), read_at)
                if not piece:
                    return False
                read_at += len(piece)
                decoder.decode(piece, final=read_at >= size)
                if not checker.feed(piece, final=read_at >= size):
                    return False
                if self._has_line_ends:
                    piece = piece.translate(None, b"\r\n")
                    os.pwrite(descriptor, piece, written_at)
                written_at += len(piece)
        except UnicodeDecodeError:
            return False
        if not checker.done():
            return False
        os.ftruncate(descriptor, written_at)
        self.file.seek(written_at)
        return True


def _dropped(pairs: list) -> None:
    return None


_DECODER = json.JSONDecoder(
    object_pairs_hook=_dropped
)  # each object dropped as it closes (`runner.json_text`)
_SPACE = " \t\n\r"


class _JsonPieces:
    """Checks that pieces fed in order make one JSON text, holding about a piece of it at a time.

    Every value that lies whole in what is held is checked by the `json` module's own scanner (`raw_decode`, in C);
    an array or object that does not is entered here, its brackets, commas and colons checked one by one and each of
    its members in turn as a value: the large answers are long arrays of small values (logprobs, embeddings), so the
    steps taken in Python are about one per member. A string or number cut by a piece's end is waited for whole (what
    is held grows for a string longer than a piece). Text is read as Latin-1, a character a byte, as
    `runner.json_text` reads it: UTF-8 is checked apart, and JSON's own characters are ASCII."""

    def __init__(self) -> None:
        self.text = ""
        self.at = 0
        self.final = False
        self.failed = False
        self.expecting = _VALUE
        self.stack: list[str] = []  # the closing bracket of each array or object entered and not yet closed

    def feed(self, piece: bytes, *, final: bool) -> bool:
        """More of the text; False once it is known not to be JSON."""
        self.text = self.text[self.at :] + str(piece, "latin-1")
        self.at = 0
        self.final = final
        while not self.failed and self._step():
            pass
        return not self.failed

    def done(self) -> bool:
        return not self.failed and self.expecting == _END and not self.text[self.at :].strip(_SPACE)

    def _step(self) -> bool:
        """One token or value; False when more text is needed (or it failed)."""
        text, at = self.text, self.at
        while at < len(text) and text[at] in _SPACE:
            at += 1
        self.at = at
        if at >= len(text):
            return False
        character, expecting = text[at], self.expecting
        if expecting == _END:
            self.failed = True
        elif expecting in (_VALUE_OR_CLOSE, _KEY_OR_CLOSE) and character == self.stack[-1]:
            self._close()
        elif expecting in (_KEY, _KEY_OR_CLOSE):
            if character != '"':
                self.failed = True
            elif self._whole_value():
                self.expecting = _COLON
            else:
                return False
        elif expecting in (_VALUE, _VALUE_OR_CLOSE):
            if self._whole_value():
                self._after_value()
            elif character in "[{" and not self.final and not self.failed:
                # NOTE: larger than what is held, or not JSON: entered, its members checked one by one
                self.stack.append("]" if character == "[" else "}")
                self.at = at + 1
                self.expecting = _VALUE_OR_CLOSE if character == "[" else _KEY_OR_CLOSE
            else:
                return False
        elif expecting == _COLON:
            self.failed = character != ":"
            self.at = at + 1
            self.expecting = _VALUE
        elif character == ",":  # _SEPARATOR
            self.at = at + 1
            self.expecting = _VALUE if self.stack[-1] == "]" else _KEY
        elif character == self.stack[-1]:
            self._close()
        else:
            self.failed = True
        return True

    def _whole_value(self) -> bool:
        """Check the value at `at` if it lies whole in what is held, and move past it. False, with `failed` set, when
        it is not JSON; False alone when it may go on past what is held (or is an array or object that does not lie
        whole in it: the caller enters it)."""
        text, at = self.text, self.at
        try:
            _, end = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(text) - 6 or len(text) - at < 64
            if self.final or not (cut or text[at] in "[{"):
                self.failed = True
            return False
        except RecursionError:
            if self.final:
                self.failed = True
            return False
        if not self.final and text[at] not in '[{"' and (end >= len(text) or text[end] in "0123456789+-.eE"):
            return False  # a number (or `true`...) may go on in the next piece
        self.at = end
        return True

    def _after_value(self) -> None:
        self.expecting = _SEPARATOR if self.stack else _END

    def _close(self) -> None:
        self.at += 1
        self.stack.pop()
        self._after_value()


_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _SEPARATOR, _END = range(7)


class SpooledRow(io.RawIOBase):
    """A line's row of the output file (`runner.answer_row`) whose answer is in a `Spool`: `head`, the file's bytes,
    `tail`, read a piece at a time as S3's client sends it (seekable: it may read it again to retry, or for its
    checksum). `len()` is its size."""

    def __init__(self, head: bytes, spool: Spool, tail: bytes) -> None:
        self._head, self._spool, self._tail = head, spool, tail
        self._body_bytes = spool.size()
        self._size = len(head) + self._body_bytes + len(tail)
        self._at = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        num = 0
        head_end = len(self._head)
        body_end = head_end + self._body_bytes
        while num < len(view) and self._at < self._size:
            at = self._at
            want = len(view) - num
            if at < head_end:
                piece = self._head[at : at + want]
            elif at < body_end:
                piece = self._spool.pread(min(want, body_end - at, PIECE_BYTES), at - head_end)
                if not piece:
                    raise OSError(f"the spooled answer ended at {at - head_end} of {self._body_bytes} bytes")
            else:
                piece = self._tail[at - body_end : at - body_end + want]
            view[num : num + len(piece)] = piece
            num += len(piece)
            self._at += len(piece)
        return num
