"""Per-model look-ups the zygote answers for the engines it forks: HF config, generation config, tokenizer, chat template.

Every engine of a model read and parsed the same files at start: the HF config (`get_config`, ~9 ms, twice
or more), the generation config, the tokenizer (~20 ms) and its chat template's Jinja compilation and content
checks (~20 ms), ~7 % of a forked engine's CPU to READY on the tiny CPU model. After a node's first start of a
model the zygote loads them itself, between handoffs, and every engine forked afterwards inherits the answers.

    engine (forked)                                     zygote (`serve_forks`, idle between handoffs)
    ---------------                                     ---------------------------------------------
    vLLM calls get_config / try_get_generation_config
      / cached_get_tokenizer -> `_Lookup`: a miss       reads the record's new lines, repeats each call once
      calls vLLM and appends the call to the record ->  (`warm_next`, one per idle wake-up), then warms the
      (`<data dir>/zygote-model-lookups.jsonl`)         tokenizer's chat template (content-keyed caches)
    a later engine: a hit, no file read            <-   fork: the answers are in its memory

Staleness: an answer is keyed by the call's arguments **and** the model directory's files (relative path,
size, mtime in ns, `files_key`), read again on every call: new weights, a changed tokenizer file or config
miss the cache and are loaded from disk. Only calls on a local directory are kept (a hub name is resolved by
vLLM, never cached here), only calls whose arguments are plain JSON values, and only with `trust_remote_code`
absent or exactly False (its answer is code from the model directory; no engine command asks for it today).

Trust: the record is written by engines (vLLM's own code, never the tenant's) into the agent's data dir; the
zygote repeats only the three look-ups below, with `trust_remote_code` false, on existing directories, and
CUDA stays untouched (none of them initialises it; the zygote checks before every fork anyway). The answers
of one tenant's model (its config, tokenizer, chat template) are in the memory of every engine forked after
the zygote loaded them. NOTE: so the agent turns this off while it confines its engines (`sandbox.py`: an engine reads
no other tenant's model folder): a confined engine could not append to the record anyway, and one tenant's parsed
files in every engine's heap would undo what the confinement keeps apart (the review of the sandbox). The agent
then gives the zygote `ZYGOTE_WARM_ENV` "0" and deletes a record left from before.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpu_agent.runtime.engine import DATA_DIR_ENV_MARKER, ZYGOTE_WARM_ENV

RECORD_NAME = "zygote-model-lookups.jsonl"
# The most recent distinct calls the zygote keeps warm (about three per model); older ones are dropped from the
# record. NOTE: a large vocabulary's tokenizer takes tens of MB in the zygote (shared with its engines).
MAX_RECORDED_CALLS = 24
# NOTE: what the zygote loads ahead comes from tenants' files, and a handoff waits while it loads. A chat template
# of a few MB took ~30 s to compile (~12 s a MB; real ones are a few KiB): every handoff of the node meanwhile
# timed out with the agent's supervisor lock held, its heartbeats stopped and the node went offline. A look-up
# repeated here is given up on after `WARM_BUDGET_S` (never tried again by this zygote: its engines load it
# themselves), and a template longer than `MAX_WARMED_TEMPLATE_CHARS` is left to its engines.
WARM_BUDGET_S = 5.0
MAX_WARMED_TEMPLATE_CHARS = 64 * 1024


class WarmTooLong(BaseException):
    """A look-up the zygote repeated ran past `WARM_BUDGET_S`. NOTE: not an `Exception`: the libraries' own
    `except Exception` fallbacks must not swallow it."""


@contextmanager
def _within(seconds: float) -> Iterator[None]:
    """Raise `WarmTooLong` in the block once `seconds` of wall clock have passed (the main thread only: SIGALRM).

    The zygote is single-threaded between handoffs; a C call (a JSON parse, a Rust tokenizer) ends before the
    signal is seen. The signal comes again every half second until the block ends (a bare `except:` in a library
    could take one)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum, _frame):
        raise WarmTooLong(f"over {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.5)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_MISSING = object()


class _InheritedState:
    """What a look-up repeated here can change for the whole process, so for every engine forked afterwards.

    In a plain launch such a change stays in the one engine whose model caused it; here it would reach every
    tenant's engine forked after the warm-up. vLLM's `get_config` sets `VLLM_USE_DEEP_GEMM_E8M0` in `os.environ`
    for a config whose `quantization_config.scale_fmt` is "ue8m0", registers its config classes with transformers'
    `AutoConfig` (`CONFIG_MAPPING`) and sets their `model_type` to the checkpoint's (one class serves several model
    types: another tenant's cached config's `to_dict()` then gave the last one's), and patches `PreTrainedConfig`
    for some model types. Made before a look-up; `restore`, after it with the alarm off, compares and puts it back.
    NOTE: a config class first imported during the look-up is seen only through vLLM's `_register_config_class`
    (its `model_type` before the first registration is kept); other changes to such a class are not. An AutoConfig
    entry a module added as it was imported is kept: engines forked from here have the module and would not add it.
    """

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.num_modules = len(sys.modules)
        self.registry = _config_registry()
        self.auto_configs = dict(self.registry._extra_content) if self.registry is not None else None
        self.classes = {cls: _own_attributes(cls) for cls in _config_classes()}
        # A config class vLLM registered during the look-up -> its own `model_type` before the first registration.
        self.registered: dict[type, object] = {}
        self.registered_types: set[str] = set()  # the model types vLLM registered them under
        self._config_module = sys.modules.get("vllm.transformers_utils.config")
        self._register = getattr(self._config_module, "_register_config_class", None)
        if self._register is not None:
            self._config_module._register_config_class = self._registering

    def _registering(self, model_type, config_class) -> None:
        self.registered.setdefault(config_class, vars(config_class).get("model_type", _MISSING))
        self.registered_types.add(model_type)
        self._register(model_type, config_class)

    def restore(self) -> list[str]:
        """Put back what changed since `__init__`; returns what that was (empty when nothing did)."""
        if self._register is not None:
            self._config_module._register_config_class = self._register
        changed = [f"environment variable {name}" for name in restore_environ(self.environ)]
        if self.registry is not None:
            entries, imported = self.registry._extra_content, len(sys.modules) != self.num_modules
            for model_type in sorted(set(entries) | set(self.auto_configs)):
                before = self.auto_configs.get(model_type, _MISSING)
                if entries.get(model_type, _MISSING) is before:
                    continue
                if before is _MISSING and imported and model_type not in self.registered_types:
                    # NOTE: kept: registered by a module as it was imported (vLLM's Ovis config registers its
                    # sub-configs), which every engine has from here, imported, and would not register again.
                    continue
                changed.append(f"AutoConfig registry entry {model_type!r}")
                if before is _MISSING:
                    del entries[model_type]
                else:
                    entries[model_type] = before
        for cls, before in self.registered.items():
            if cls not in self.classes and vars(cls).get("model_type", _MISSING) is not before:
                changed.append(f"{cls.__qualname__}.model_type")
                _set_own_attribute(cls, "model_type", before)
        for cls, before in self.classes.items():
            after = _own_attributes(cls)
            for name in sorted(set(before) | set(after)):
                if after.get(name, _MISSING) is not before.get(name, _MISSING):
                    changed.append(f"{cls.__qualname__}.{name}")
                    _set_own_attribute(cls, name, before.get(name, _MISSING))
        return changed


def restore_environ(saved: dict[str, str]) -> list[str]:
    """Make `os.environ` equal to `saved` again; returns the names that differed.

    NOTE: only those are set or removed, never `os.environ.clear()`: `setproctitle` (vLLM names its processes
    with it) finds the process's arguments from where the first environment string lies, and a cleared and
    refilled environment lies elsewhere: every engine forked afterwards kept the zygote's command line as title.
    """
    changed = sorted(name for name in set(os.environ) | set(saved) if os.environ.get(name) != saved.get(name))
    for name in changed:
        if name in saved:
            os.environ[name] = saved[name]
        else:
            del os.environ[name]
    return changed


def _config_registry():
    """transformers' `CONFIG_MAPPING` (what `AutoConfig.register` adds to), when transformers is imported."""
    module = sys.modules.get("transformers.models.auto.configuration_auto")
    registry = getattr(module, "CONFIG_MAPPING", None)
    return registry if isinstance(getattr(registry, "_extra_content", None), dict) else None


def _config_classes() -> list[type]:
    """`PreTrainedConfig` and every subclass of it imported so far."""
    module = sys.modules.get("transformers.configuration_utils")
    base = getattr(module, "PreTrainedConfig", None)
    if not isinstance(base, type):
        return []
    found, pending = {base}, [base]
    while pending:
        for subclass in type.__subclasses__(pending.pop()):
            if subclass not in found:
                found.add(subclass)
                pending.append(subclass)
    return list(found)


def _own_attributes(cls: type) -> dict:
    # NOTE: dunder names left out: copying an instance caches `__slotnames__` on its class, harmlessly.
    return {name: value for name, value in vars(cls).items() if not name.startswith("__")}


def _set_own_attribute(cls: type, name: str, value) -> None:
    if value is _MISSING:
        if name in vars(cls):
            delattr(cls, name)
    else:
        setattr(cls, name, value)


def files_key(path) -> tuple | None:
    """What a cached answer for a local model directory depends on: every file's relative path, size and mtime.

    None for anything but an existing directory (a hub name, a single file): such a call is not cached.
    Symbolic links (a Hugging Face snapshot's files) are followed: the blob's size and mtime count.
    """
    try:
        root = os.fspath(path)
    except TypeError:
        return None
    if not isinstance(root, str) or not os.path.isdir(root):
        return None
    entries = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories.sort()
        for name in sorted(names):
            full = os.path.join(directory, name)
            try:
                stat = os.stat(full)
            except OSError:
                continue
            entries.append((os.path.relpath(full, root), stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


def _plain(value) -> bool:
    if value is None or isinstance(value, str | bool | int | float):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _plain(item) for key, item in value.items())
    return False


def _call_text(args: tuple, kwargs: dict) -> str | None:
    """The call as canonical JSON (the cache key and the record's line), or None when it may not be cached.

    NOTE: `trust_remote_code` (each look-up's second positional argument, or the keyword) must be absent or the
    literal False. The record is a file any engine appends to, and transformers takes any true value (`1`,
    `"yes"`) as trust: it would run the model directory's own code (`auto_map`) in the zygote, the parent of
    every engine forked after it.
    """
    trust = [*args[1:2], *([kwargs["trust_remote_code"]] if "trust_remote_code" in kwargs else [])]
    if any(value is not False for value in trust):
        return None
    args = (os.fspath(args[0]), *args[1:]) if args and isinstance(args[0], Path) else args
    if not _plain(args) or not _plain(kwargs):
        return None
    return json.dumps([list(args), kwargs], sort_keys=True)


class _Lookup:
    """One of vLLM's per-model look-ups, answered from memory for unchanged model directories."""

    def __init__(self, name: str, function, copy_answer: bool, fallback=None) -> None:
        self.name = name
        self.function = function  # loads from disk
        self.fallback = fallback or function  # what vLLM called for a call not kept here (a hub name)
        self.copy_answer = copy_answer  # configs are mutable, each caller got its own; a tokenizer is shared
        # call -> (files_key, answer): one per call, for the files as they were when it was loaded
        self.answers: dict[str, tuple[tuple, object]] = {}
        self.num_hits = 0
        self.__wrapped__ = self.fallback

    def __call__(self, *args, **kwargs):
        call = _call_text(args, kwargs)
        files = files_key(args[0]) if call is not None and args else None
        if files is None:
            return self.fallback(*args, **kwargs)
        kept = self.answers.get(call)
        if kept is not None and kept[0] == files:
            self.num_hits += 1
            return copy.deepcopy(kept[1]) if self.copy_answer else kept[1]
        answer = self.function(*args, **kwargs)
        # NOTE: kept under the files as they were before the load: one changed meanwhile misses the next call.
        if self._keep(call, files, answer) and _recording:
            _record(self.name, call)
        return answer

    def _keep(self, call: str, files: tuple, answer) -> bool:
        try:
            self.answers[call] = (files, copy.deepcopy(answer) if self.copy_answer else answer)
        except Exception:  # noqa: BLE001 - a config that cannot be copied is loaded by every caller, as before
            return False
        return True

    def warm(self, call: str) -> bool:
        """Repeat a recorded call here (the zygote); True when an answer was loaded."""
        args, kwargs = json.loads(call)
        # NOTE: the record is a file: only a canonical call of a plain, cacheable form is repeated here.
        if (
            not isinstance(args, list)
            or not isinstance(kwargs, dict)
            or _call_text(tuple(args), kwargs) != call
        ):
            return False
        if not args or files_key(args[0]) is None:
            self.answers.pop(call, None)  # a model no longer on disk (evicted): its answer goes too
            return False
        kept = self.answers.get(call)
        if kept is not None and kept[0] == files_key(args[0]):
            return False
        self.answers.pop(call, None)  # the stale answer goes first: an error leaves none
        files = files_key(args[0])  # NOTE: before the load: a file changed during it makes the next call miss
        return self._keep(call, files, self.function(*args, **kwargs))


LOOKUPS: dict[str, _Lookup] = {}  # by name, once `install` ran
_recording = True  # off while the zygote loads (a look-up's own nested misses are not the engines')


def install() -> dict:
    """Wrap vLLM's look-ups in this process; returns {id of an original function: its `_Lookup`} for `rebind`."""
    from vllm.tokenizers import registry
    from vllm.transformers_utils import config

    originals = {
        "get_config": (config, "get_config", True),
        "try_get_generation_config": (config, "try_get_generation_config", True),
        "cached_get_tokenizer": (registry, "cached_get_tokenizer", False),
    }
    replaced = {}
    for name, (module, attribute, copy_answer) in originals.items():
        original = getattr(module, attribute)
        if isinstance(original, _Lookup):
            continue
        # NOTE: `cached_get_tokenizer` is vLLM's `lru_cache` of `get_tokenizer`, keyed by name: wrapped, it would
        # answer a changed directory from its own memory (or the zygote's). Its answers come from here instead.
        uncached = getattr(original, "__wrapped__", original) if hasattr(original, "cache_info") else original
        lookup = _Lookup(name, uncached, copy_answer, fallback=original)
        LOOKUPS[name] = lookup
        replaced[id(original)] = lookup
    rebind(replaced, list(sys.modules.items()))
    return replaced


def rebind(replaced: dict, modules) -> None:
    """Point every vLLM module's own name for an original look-up at its `_Lookup` (they import them by name)."""
    if not replaced:
        return
    for name, module in modules:
        if not name.startswith("vllm"):
            continue
        namespace = vars(module)
        for attribute, value in list(namespace.items()):
            lookup = replaced.get(id(value))
            if lookup is not None and lookup.fallback is value:
                namespace[attribute] = lookup


def record_path() -> Path | None:
    """The node's record of look-ups; None where nothing is recorded nor loaded ahead (`ZYGOTE_WARM_ENV` "0")."""
    data_dir = os.environ.get(DATA_DIR_ENV_MARKER)
    if not data_dir or os.environ.get(ZYGOTE_WARM_ENV) == "0":
        return None
    return Path(data_dir) / RECORD_NAME


def _record(name: str, call: str) -> None:
    """Append a missed call to the node's record (engines: the zygote loads it for the next ones)."""
    path = record_path()
    if path is None:
        return
    try:
        # NOTE: one short line per write (O_APPEND): lines of engines starting at once do not interleave.
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"lookup": name, "call": call}) + "\n")
    except OSError:
        pass


class Warmer:
    """The zygote's side: repeat recorded calls, one per idle wake-up, so a handoff waits for one call at most."""

    def __init__(self) -> None:
        self.path = record_path()
        self._seen_size = -1
        self._pending: list[tuple[str, str]] = []
        self._failed: set[tuple[str, str]] = set()
        # Calls loaded once more after they changed what engines inherit: an import on the way may have done it.
        self._retried: set[tuple[str, str]] = set()
        self.num_warmed = 0

    def warm_next(self) -> bool:
        """Load one recorded answer that is missing or stale; False when there is nothing to do."""
        global _recording
        _recording = False
        try:
            return self._warm_next()
        finally:
            _recording = True

    def _warm_next(self) -> bool:
        self._read_record()
        while self._pending:
            name, call = self._pending.pop(0)
            lookup = LOOKUPS.get(name)
            if lookup is None or (name, call) in self._failed:
                continue
            started_at = time.process_time()
            state = _InheritedState()
            failure = None
            try:
                with _within(WARM_BUDGET_S):
                    warmed = lookup.warm(call)
                    if warmed and name == "cached_get_tokenizer":
                        _warm_chat_template(lookup.answers[call][1])
            except (Exception, WarmTooLong) as exc:  # noqa: BLE001 - a model the zygote cannot load: its engines load it
                failure = exc
            finally:
                changed = state.restore()  # NOTE: after `_within`: the alarm cannot interrupt putting it back
            if changed:
                # NOTE: its answer goes too: it was made with the changes, which its own engines must make for
                # themselves (a cached answer skips them), as a plain launch does. A module imported on the way may
                # have made them instead (OpenCV's import extends LD_LIBRARY_PATH): loaded once more, with the
                # module imported, the look-up shows what it changes itself.
                lookup.answers.pop(call, None)
                again = state.num_modules != len(sys.modules) and (name, call) not in self._retried
                print(
                    f"zygote: warning: loading {name} ahead changed what every engine forked from here inherits "
                    f"({', '.join(changed)}); put back, "
                    + ("loading it once more" if again else "and left to its engines"),
                    file=sys.stderr,
                    flush=True,
                )
                if again:
                    self._retried.add((name, call))
                    self._pending.insert(0, (name, call))
                    return True
            if failure is not None or changed:
                self._failed.add((name, call))
                if failure is not None:
                    print(f"zygote: could not load {name} ahead ({failure!r})", file=sys.stderr, flush=True)
                return True  # NOTE: one look-up per wake-up, failed or not: a handoff may be waiting
            if warmed:
                self.num_warmed += 1
                print(
                    f"zygote: {name} loaded ahead in {time.process_time() - started_at:.3f}s of CPU",
                    file=sys.stderr,
                    flush=True,
                )
                return True
        return False

    def _read_record(self) -> None:
        if self.path is None:
            return
        try:
            size = self.path.stat().st_size
        except OSError:
            return
        if size == self._seen_size:
            return
        self._seen_size = size
        calls: dict[tuple[str, str], None] = {}
        try:
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return
        for line in lines:
            try:
                entry = json.loads(line)
                key = (str(entry["lookup"]), str(entry["call"]))
            except (ValueError, KeyError, TypeError):
                continue
            calls.pop(key, None)
            calls[key] = None  # the most recent last
        recent = list(calls)[-MAX_RECORDED_CALLS:]
        for name, call in list(calls)[:-MAX_RECORDED_CALLS]:  # dropped from the record: from memory too
            lookup = LOOKUPS.get(name)
            if lookup is not None:
                lookup.answers.pop(call, None)
        if len(recent) < len(lines):
            self._rewrite(recent)
        self._pending = recent  # every recorded call is checked again: `warm` skips the fresh ones

    def _rewrite(self, calls: list[tuple[str, str]]) -> None:
        """Keep the record short: one line per distinct recent call."""
        temporary = self.path.with_suffix(".tmp")
        try:
            temporary.write_text(
                "".join(json.dumps({"lookup": name, "call": call}) + "\n" for name, call in calls),
                encoding="utf-8",
            )
            os.replace(temporary, self.path)
            self._seen_size = self.path.stat().st_size
        except OSError:
            pass


def _warm_chat_template(tokenizer) -> None:
    """Compile the tokenizer's chat template here: the caches involved are keyed by the template's text."""
    try:
        template = tokenizer.get_chat_template(None, tools=None)
    except Exception:  # noqa: BLE001 - no chat template: nothing to warm
        return
    if not isinstance(template, str) or len(template) > MAX_WARMED_TEMPLATE_CHARS:
        return
    from transformers.utils.chat_template_utils import _compile_jinja_template
    from vllm.renderers import hf

    _compile_jinja_template(template)
    for default in ("string", "openai"):
        hf._detect_content_format(template, default=default)
    hf._detect_developer_role_support(template)
