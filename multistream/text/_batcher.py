"""Continuous batching for causal LMs: one batched forward per step for every running request.

Each engine step:

1. requests whose consumer cancelled or finished early leave at once (their rows are dropped);
2. if a waiting request outranks the lowest-priority running one and the batch is full, that one
   is paused: its row leaves the batch with its KV cache, to rejoin later without recomputing;
3. waiting requests are prefilled, highest priority first, up to ``prefill_budget`` prompt tokens
   per step (a long prompt takes several steps, in chunks, so running streams are never stalled
   for more than one chunk); a request whose prompt is done gets its first token at once;
4. prefilled requests join the batch while there is room (``max_batch`` rows);
5. one forward for all rows of the batch, each row's next token chosen by its own sampler.

A request that arrives *during* that forward does not wait for it to end: every few decoder
layers a pre-hook (a "prefill point") admits newcomers and, if one will get a row at the next
step boundary, prefills it there and then, so its first token goes out without waiting for the
rest of the step (time to first token under load is about the prefill plus a fraction of a
step, not plus a whole step). The batched forward resumes afterwards untouched: the newcomer
has its own cache and joins the batch at the next boundary. A group prefill has prefill points
too, open only to higher priorities. The boundary and the prefill points share one
``prefill_budget`` per step, and a newcomer is prefilled at a point only if a row is sure to be
free for it (or taken, one each, from a lower priority) at the next boundary.

Rows share one left-padded KV cache (`RowCache`); each row has its own position ids, so a row's
logits are those it would get alone (test: greedy output in a batch equals the output alone).

Example (what `TextModel` does):
    >>> batcher = TextBatcher(model, max_batch=16, prefill_budget=256)   # doctest: +SKIP
    >>> engine = Engine(batcher, name="smollm2")                         # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import threading
import weakref
from itertools import count
from typing import Any, Callable, NamedTuple

import torch

from ..errors import InvalidArgumentError
from ._accel.fast_decode import PREFILL_POINTS, FastDecode
from ._accel.native_layers import native_layer
from ._accel.row_attention import uses_row_attention
from ._constraints import apply_masks
from ._kv_rows import RowCache, supports_row_cache
from ._logprobs import TokenTable, entries
from ._prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache
from ._request import TextRequest
from ._sampling import Penalties, adjust_rows

__all__ = ["DEFAULT_MAX_BATCH", "SharedPrompt", "TextBatcher"]

#: Rows a text model's engine decodes together by default: its capacity (``load_text_model(max_batch=)``).
DEFAULT_MAX_BATCH = 16

logger = logging.getLogger("multistream")

_ANY = (float("inf"), float("inf"))  # during a decode, any newcomer may take a prefill point
_PREFILL_POINTS = PREFILL_POINTS  # per decode forward: a newcomer waits at most about 1/N of a step


def _decoder_layers(model: Any) -> list[Any]:
    """The model's stack of decoder layers (the first ModuleList as long as the config says), or []."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    n = next((getattr(config, k) for k in ("num_hidden_layers", "n_layer", "num_layers")
              if isinstance(getattr(config, k, None), int)), None)
    if not n:
        return []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return list(module)
    return []


def _forward_replaced(model: Any) -> bool:
    """True if the instance's ``forward`` is not its class's: a wrapper, accelerate's hooks or a spy
    is the user's say in what a step runs, so the fast step stands aside. A patch that was undone by
    setting the original bound method back (what pytest's ``monkeypatch`` leaves on the instance)
    is the class's forward again.

    Example:
        >>> class Net:
        ...     def forward(self): ...
        >>> net = Net(); _forward_replaced(net)
        False
        >>> net.forward = net.forward; _forward_replaced(net)   # put back as it was
        False
        >>> net.forward = lambda: None; _forward_replaced(net)
        True
    """
    own = vars(model).get("forward")
    if own is None:
        return False
    return getattr(own, "__func__", None) is not getattr(type(model), "forward", None) or own.__self__ is not model


def _one_arithmetic(model: Any) -> bool:
    """True if every decoder layer runs on the native layers, which compute each position alone:
    a prompt prefilled in pieces (chunks, a cached prefix) then gives what one forward gives."""
    layers = _decoder_layers(model)
    return bool(layers) and all(native_layer(layer) is not None for layer in layers)


def _unstarted(req: TextRequest) -> bool:
    """Nothing of the prompt prefilled yet, or only the start the prefix cache gave it."""
    row = req.row
    return (row.own_cache is None and row.prefilled == 0) or (
        row.cached_prompt_tokens > 0 and row.prefilled == row.cached_prompt_tokens and row.needs_prefill)


class Forward(NamedTuple):
    """What the engine reads of a forward: the logits and the cache it grew."""

    logits: torch.Tensor
    cache: Any


def _returned_cache(out: Forward, given: Any) -> Any:
    return given if out.cache is None else out.cache


def _left_padding(mask: torch.Tensor) -> list[int] | None:
    """Each row's padding columns, if every row is padding then tokens (None otherwise)."""
    first = mask.to(torch.int8).argmax(1)
    if not bool(torch.equal(mask.sum(1).to(first.dtype), mask.shape[1] - first)):
        return None
    return [int(i) for i in first.tolist()]


def _rank(req: TextRequest) -> tuple[int, int]:
    """Sort key: higher priority first, then first come first served."""
    return (-req.priority, req.row.order)


# JSON has no -inf; vLLM reports impossible tokens as -9999.0 too.
_LOGPROB_FLOOR = -9999.0


class SharedPrompt:
    """``n`` requests of one prompt (an ``n``-choice request) prefilled once.

    The first of them to be prefilled (the leader) leaves a copy of its prompt's KV row and the
    prompt's last logits here; every other member copies that row into its own instead of running
    the prompt again (its first token is drawn from the same logits by its own sampler). The copy is
    dropped once every member has taken it; a member that arrives late still finds it.

    Example (what `TextModel.choices` does):
        >>> share = SharedPrompt(members=4)
        >>> share.remaining
        4
    """

    def __init__(self, members: int) -> None:
        self.remaining = members
        self.leader: TextRequest | None = None
        self.rows: RowCache | None = None
        self.logits: torch.Tensor | None = None
        self.context: list[int] | None = None

    def ready_for(self, req: TextRequest) -> bool:
        return (self.rows is not None and req.row.prefilled == 0 and req.row.own_cache is None
                and req.row.context == self.context)

    def waits(self, req: TextRequest) -> bool:
        """True while another member's prefill, which will serve ``req`` too, is under way."""
        leader = self.leader
        return self.rows is None and leader is not None and leader is not req and not leader.done

    def keep(self, req: TextRequest, rows: RowCache, index: int, logits: torch.Tensor) -> None:
        """The leader's prefill is done: keep a copy of its row (before its first token is added)."""
        req.row.share = None
        self.remaining -= 1
        if self.remaining > 0:
            self.rows, self.logits, self.context = rows.select([index]), logits.detach().clone(), list(req.row.context)

    def take(self, req: TextRequest) -> tuple[RowCache, torch.Tensor]:
        assert self.rows is not None and self.logits is not None
        req.row.share = None
        rows, logits = self.rows.select([0]), self.logits  # a copy each: a row's cache grows in place
        self.remaining -= 1
        if self.remaining <= 0:
            self.rows = self.logits = self.context = None
        return rows, logits


class TextBatcher:
    """The engine backend of a causal LM (see the module docstring for one step)."""

    def __init__(self, model: Any, *, max_batch: int = DEFAULT_MAX_BATCH, prefill_budget: int = 512,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        self.model = model
        self.max_batch = max_batch
        self.prefill_budget = prefill_budget
        self.device = next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        # transformers 5.2x renamed `past_key_values` to `cache`; speak whichever this model knows.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # A model with its own engine cache (the embedded one: `KVCache`) also answers return_dict=False
        # with a plain tuple: neither imports transformers. Others get DynamicCache and ModelOutput.
        self._own_cache = getattr(model, "new_cache", None)
        self._mergeable: bool | None = None  # known after the first prefill
        self.waiting: list[TextRequest] = []
        self.batch: list[TextRequest] = []
        self.rows: RowCache | None = None
        self._arrivals = count()
        self.steps = 0  # decode steps run (tests and benchmarks read it)
        self.prefills_inside_steps = 0  # newcomers prefilled at a prefill point (tests read it)
        self._poll_arrivals: Callable[[], int] | None = None
        self._arrival_flag: ctypes.c_int32 | None = None  # the engine's flag, for the native decode
        # While a forward runs with its prefill points open: the rank a newcomer must beat (_ANY
        # during a decode); None otherwise. Plus the requests that forward is prefilling.
        self._open_for: tuple[float, float] | None = None
        self._prefilling: list[TextRequest] = []
        self._budget_left = prefill_budget  # of this step's prefill budget
        self._engine_thread = 0
        self._hooks: list[Any] = []
        self._point_layers: frozenset[int] = frozenset()  # layer indices with a prefill point
        self._fast: FastDecode | None = None
        self._fast_checked = False
        # Prompts' KV rows for later prompts that begin alike (`PrefixCache`): only where a chunked
        # prefill is exact, i.e. every decoder layer runs on the native layers (one arithmetic).
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 and _one_arithmetic(model) else None

    # -- Backend --------------------------------------------------------------------------------

    def admit(self, request: TextRequest) -> None:
        if request.at_length_limit():
            # A continued answer (a failover, a restart) that already has all its tokens: the
            # replica died after the last token and before the final event. It ends as it would
            # have, with no token more.
            request.finish("length")
            return
        request.row.order = next(self._arrivals)
        self._start_from_cached_prefix(request)
        self.waiting.append(request)

    def _start_from_cached_prefix(self, req: TextRequest) -> None:
        """A prompt that begins like one prefilled before starts from that one's KV rows: only the
        rest is prefilled (as a prompt's later chunks are)."""
        row = req.row
        if self.prefix_cache is None or row.prefilled or row.own_cache is not None or row.share is not None:
            return
        hit = self.prefix_cache.lookup(row.context, salt=req.spec.options.cache_salt)
        if hit is not None:
            row.prefilled, rows = hit
            row.own_cache = (rows, 0)
            row.cached_prompt_tokens = row.prefilled

    def _remember_prompt(self, req: TextRequest, rows: RowCache, index: int) -> None:
        if self.prefix_cache is not None and req.beams is None:
            self.prefix_cache.store(req.row.context, rows, index, salt=req.spec.options.cache_salt)

    def has_work(self) -> bool:
        return bool(self.waiting or self.batch)

    def step(self) -> None:
        # One prefill budget per step, shared by the boundary and the prefill points, so running
        # streams are never held up by more than one budget's worth of prefill.
        self._budget_left = self.prefill_budget
        self._apply_edits()
        self._drop_ended()
        self._make_room_for_priority()
        self._prefill()
        self._join()
        if self.batch:
            self._decode()

    def fail_all(self, exc: BaseException) -> None:
        for req in self.batch + self.waiting:
            req.fail(exc)
        self.batch, self.waiting, self.rows = [], [], None

    def shutdown(self) -> None:
        for req in self.batch + self.waiting:
            req.finish("cancelled")
        self.batch, self.waiting, self.rows = [], [], None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- prefill points -------------------------------------------------------------------------

    def enable_prefill_points(self, poll_arrivals: Callable[[], int], arrivals: ctypes.c_int32 | None = None) -> None:
        """Prefill newcomers part-way through a decode forward (see the module docstring).

        ``poll_arrivals`` (the engine's `Engine.poll_arrivals`) admits what arrived since the step
        began; ``arrivals`` (`Engine.arrivals`), a flag set while one waits, lets the native decode
        check at its points without leaving C. Models whose decoder layers cannot be found keep
        prefilling at step boundaries only.
        """
        layers = _decoder_layers(self.model)
        if not layers or self._hooks:
            return
        self._poll_arrivals = poll_arrivals
        self._arrival_flag = arrivals
        spacing = max(1, len(layers) // _PREFILL_POINTS)
        # A hook that holds the batcher only weakly: the user's model stays copyable
        # (copy.deepcopy, torch.save) and does not keep the engine alive.
        batcher = weakref.ref(self)

        def prefill_point(module: Any, args: Any) -> None:
            this = batcher()
            if this is not None:
                this._prefill_point()

        # Not before the first layer: the step boundary just before it has already looked.
        self._hooks = [layer.register_forward_pre_hook(prefill_point) for layer in layers[spacing::spacing]]
        self._point_layers = frozenset(range(spacing, len(layers), spacing))  # the fast decode calls them itself

    def _prefill_point(self) -> None:
        # The hooks sit on the user's model: only the engine's own batched decode stops here (not a
        # prefill, not the user calling the model on another thread).
        open_for = self._open_for
        if open_for is None or threading.get_ident() != self._engine_thread:
            return
        assert self._poll_arrivals is not None
        if not self._poll_arrivals():
            return
        group = self._newcomers_to_prefill_now(open_for)
        if not group:
            return
        outer = self._prefilling
        from_cache = [r for r in group if r.row.own_cache is not None]
        whole = [r for r in group if r.row.own_cache is None]
        try:
            if whole:
                self._guarded(self._prefill_group, whole)  # closes the points for its own forward
            for req in from_cache:  # the rest of a prompt that started from a cached prefix
                if not req.done:
                    self._open_for, self._prefilling = None, [req]  # no points inside its forward
                    self._guarded(self._prefill_chunk, [req], len(req.row.uncached))
            self.prefills_inside_steps += sum(1 for r in group if not r.row.needs_prefill)
        finally:
            self._open_for, self._prefilling = open_for, outer
        self.waiting = [r for r in self.waiting if not r.done]

    def _newcomers_to_prefill_now(self, open_for: tuple[float, float]) -> list[TextRequest]:
        """Fresh whole prompts (one priority, within what is left of this step's prefill budget,
        ranked before ``open_for``) that will get a row at the next step boundary: a free one, or
        one that `_make_room_for_priority` takes from a lower-ranked running request (one each)."""
        ready = sum(r.width for r in self.waiting if not r.row.needs_prefill and not r.done)
        free_rows = self.capacity - self._rows_used() - ready - sum(r.width for r in self._prefilling)
        # Rows a newcomer can take by pausing a running request, worst first (a cache that cannot
        # be split gives none; beam searches are not paused).
        victims = sorted((_rank(r) for r in self.batch if r.beams is None), reverse=True) if self._mergeable else []
        group: list[TextRequest] = []
        for req in sorted(self.waiting, key=_rank):
            if req.done or not req.row.needs_prefill or req in self._prefilling or req.check_flags():
                continue
            if req.row.share is not None:
                if req.row.share.rows is not None or req.row.share.waits(req):
                    continue  # served by a copy of another member's prefill, at the boundary
                req.row.share.leader = req
            fresh = _unstarted(req) and len(req.row.uncached) <= self._budget_left
            if not fresh or req.width > 1 or _rank(req) >= open_for or (group and req.priority != group[0].priority):
                break
            if free_rows > 0:
                free_rows -= 1
            elif victims and _rank(req) < victims[0]:
                victims.pop(0)
            else:
                break
            group.append(req)
            self._budget_left -= len(req.row.uncached)
        return group

    # -- capacity -------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Rows per step: ``max_batch``, or 1 for caches that cannot be split (sliding windows)."""
        return self.max_batch if self._mergeable is not False else 1

    def _rows_used(self) -> int:
        return sum(req.width for req in self.batch)

    def _first_row(self, i: int) -> int:
        """Row of the cache where request ``i`` of the batch begins (a beam search takes several)."""
        return sum(req.width for req in self.batch[:i])

    def _drop_ended(self) -> None:
        for req in self.waiting:
            req.check_flags()
        self.waiting = [r for r in self.waiting if not r.done]
        ended = [i for i, req in enumerate(self.batch) if req.check_flags()]
        if ended:
            self._remove_rows(ended)

    def _remove_rows(self, indices: list[int]) -> None:
        """Drop requests ``indices`` of the batch, and their rows."""
        gone = set(indices)
        keep = [i for i in range(len(self.batch)) if i not in gone]
        rows = [self._first_row(i) + j for i in keep for j in range(self.batch[i].width)]
        self.batch = [self.batch[i] for i in keep]
        if not keep or self.rows is None:
            self.rows = None
        elif self._mergeable:
            self.rows = self.rows.select(rows)

    def _apply_edits(self) -> None:
        """Steers and rewinds: the row leaves the batch with its cache, cut back as the edit says,
        and rejoins after its new tokens are prefilled (only those: the rest stays cached)."""
        edited = [i for i, req in enumerate(self.batch) if req.edits]
        if edited:
            assert self.rows is not None
            for i in edited:
                self.batch[i].row.own_cache = (self.rows.select([self._first_row(i)]), 0) if self._mergeable else (self.rows, 0)
            moved = [self.batch[i] for i in edited]
            self._remove_rows(edited)
            self.waiting.extend(moved)
        for req in self.waiting:
            if not req.edits or req.done:
                continue
            own: RowCache | None = None
            if req.row.own_cache is not None:
                rows, index = req.row.own_cache
                own = rows if rows.rows == 1 else rows.select([index])
            for edit in req.edits.take():
                keep = req.apply_edit(edit)
                if own is not None:
                    own = own.crop(keep) if keep > 0 else None
            req.row.own_cache = (own, 0) if own is not None else None
            if own is None:
                req.row.prefilled = 0

    def _make_room_for_priority(self) -> None:
        """Pause the lowest-ranked running rows while better-ranked requests wait for a row."""
        if not self._mergeable or not self.waiting:
            return
        waiting = sorted(self.waiting, key=_rank)
        while waiting and self._rows_used() + waiting[0].width > self.capacity:
            pausable = [i for i in range(len(self.batch)) if self.batch[i].beams is None]
            if not pausable:
                return
            worst = max(pausable, key=lambda i: _rank(self.batch[i]))
            if _rank(waiting[0]) >= _rank(self.batch[worst]):
                return
            paused = self.batch[worst]
            assert self.rows is not None
            paused.row.own_cache = (self.rows.select([self._first_row(worst)]), 0)
            self._remove_rows([worst])
            self.waiting.append(paused)
            waiting.pop(0)

    # -- prefill --------------------------------------------------------------------------------

    def _prefill(self) -> None:
        """Prefill waiting requests, best first, within the token budget and the free rows.

        Whole prompts of the same priority that fit the budget are prefilled together in one
        left-padded forward (one pass over the weights for all of them); a prompt longer than the
        budget goes alone, one chunk per step.
        """
        self._copy_shared()
        budget = self._budget_left
        for req in self.waiting:
            if req.width > self.capacity and not req.done:
                # Never fits (a cache that cannot be split runs one row per step): say so, do not hang.
                req.fail(InvalidArgumentError(
                    f"num_beams={req.width} needs {req.width} rows of a batch but this model runs {self.capacity} "
                    "(its cache cannot be split by row); use num_beams=1"))
        self.waiting = [r for r in self.waiting if not r.done]
        free_rows = self.capacity - self._rows_used()
        group: list[TextRequest] = []
        for req in sorted(self.waiting, key=_rank):
            if free_rows < req.width or budget <= 0:
                break
            if not req.row.needs_prefill:
                free_rows -= req.width  # paused earlier, its cache is ready: it takes a row first
                continue
            if req.row.share is not None:
                if req.row.share.waits(req):
                    continue  # another member's prefill serves it (copied just after)
                req.row.share.leader = req
            remaining = len(req.row.context) - req.row.prefilled
            if group and req.priority != group[0].priority:
                break  # a higher priority is prefilled on its own, so its first token is not held up
            if req.row.prefilled == 0 and req.row.own_cache is None and remaining <= budget:
                group.append(req)
                budget -= remaining
                free_rows -= req.width
            elif _unstarted(req) and remaining <= budget:
                # Its prompt's start came from the prefix cache: the rest in a forward of its own.
                self._guarded(self._prefill_chunk, [req], remaining)
                budget -= remaining
                free_rows -= req.width
            elif not group:
                self._guarded(self._prefill_chunk, [req], min(budget, remaining))
                budget = 0
        self._budget_left = budget
        if group:
            self._guarded(self._prefill_group, group)
        self._copy_shared()
        self.waiting = [r for r in self.waiting if not r.done]

    def _copy_shared(self) -> None:
        """Members of an n-choice request whose prompt another member prefilled: each copies that
        row (no forward) and draws its first token, while rows are free."""
        free_rows = self.capacity - len(self.batch) - sum(1 for r in self.waiting if not r.row.needs_prefill and not r.done)
        for req in sorted(self.waiting, key=_rank):
            if free_rows <= 0:
                return
            share = req.row.share
            if req.done or not req.row.needs_prefill or share is None or not share.ready_for(req) or req.check_flags():
                continue
            rows, logits = share.take(req)
            req.row.own_cache = (rows, 0)
            req.row.prefilled = len(req.row.context)
            self._first_token(req, logits)
            free_rows -= 1

    def _guarded(self, fn: Any, reqs: list[TextRequest], *args: Any) -> None:
        try:
            fn(reqs, *args)
        except Exception as exc:  # noqa: BLE001 - these requests fail; the others go on
            logger.exception("prefill failed for %d stream(s)", len(reqs))
            for req in reqs:
                req.fail(exc)

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> Forward:
        extra: dict[str, Any] = {self._cache_arg: cache}
        if mask.shape[0] > 1 and uses_row_attention(self.model):
            starts = _left_padding(mask)
            if starts is not None:
                extra["row_starts"] = starts  # each row attends to its own columns only (_row_attention)
        out = self._call(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **extra)
        if self._mergeable is None:
            self._mergeable = supports_row_cache(_returned_cache(out, cache))
        return out

    def _call(self, **kwargs: Any) -> Forward:
        """The model's forward, as `Forward` (the embedded model answers a plain tuple)."""
        if self._own_cache is not None:
            logits, *rest = self.model(**kwargs, return_dict=False)
            return Forward(logits, rest[0] if rest else None)
        out = self.model(**kwargs)
        return Forward(out.logits, out[self._cache_arg])

    def _empty_cache(self) -> Any:
        if self._own_cache is not None:
            return self._own_cache()
        from transformers import DynamicCache

        return DynamicCache()

    def _prefill_group(self, group: list[TextRequest]) -> None:
        if len(group) > 1 and self._mergeable is False:
            group = group[:1]
        width = max(len(r.row.context) for r in group)
        ids, mask, positions = [], [], []
        for req in group:
            pad = width - len(req.row.context)
            ids.append([req.row.context[0]] * pad + req.row.context)
            mask.append([0] * pad + [1] * len(req.row.context))
            positions.append([0] * pad + list(range(len(req.row.context))))
        cache = self._empty_cache()
        mask_t = torch.tensor(mask, device=self.device)
        # Only a higher priority may be prefilled part-way through this one.
        self._open_for = _rank(group[0]) if self._poll_arrivals is not None else None
        self._prefilling = group
        self._engine_thread = threading.get_ident()
        try:
            out = self._forward(
                torch.tensor(ids, device=self.device), mask_t, torch.tensor(positions, device=self.device), cache
            )
        finally:
            self._open_for, self._prefilling = None, []
        rows = RowCache(_returned_cache(out, cache), mask_t)
        for i, req in enumerate(group):
            req.row.prefilled = len(req.row.context)
            req.row.own_cache = (rows, i)
            self._remember_prompt(req, rows, i)
            if req.row.share is not None:
                req.row.share.keep(req, rows, i, out.logits[i, -1])
            self._first_token(req, out.logits[i, -1])

    def _prefill_chunk(self, reqs: list[TextRequest], n: int) -> None:
        (req,) = reqs
        start = req.row.prefilled
        ids = req.row.context[start : start + n]
        cache = req.row.own_cache[0].cache if req.row.own_cache is not None else self._empty_cache()
        mask = torch.ones(1, start + n, dtype=torch.long, device=self.device)
        out = self._forward(
            torch.tensor([ids], device=self.device), mask,
            torch.arange(start, start + n, device=self.device).unsqueeze(0), cache,
        )
        req.row.own_cache = (RowCache(_returned_cache(out, cache), mask), 0)
        req.row.prefilled += n
        if req.row.prefilled >= len(req.row.context):
            self._remember_prompt(req, req.row.own_cache[0], 0)
            if req.row.share is not None:
                req.row.share.keep(req, req.row.own_cache[0], 0, out.logits[0, -1])
            self._first_token(req, out.logits[0, -1])

    def _first_token(self, req: TextRequest, logits: torch.Tensor) -> None:
        # The first token goes out now: time to first token is queueing plus prefill.
        req.row.needs_prefill = False
        try:
            if req.beams is not None:
                # The beams start from the prompt's one row; the first step picks k distinct tokens
                # and the row is copied k times (the join selects it once per beam).
                req.accept_beams(logits.unsqueeze(0))
                rows, index = req.row.own_cache if req.row.own_cache is not None else (None, 0)
                if rows is not None:
                    req.row.own_cache = (rows, [index] * req.width)
                return
            raw_logits = logits  # logprobs are the model's own, before any mask
            if req.row.forced_token is not None:  # a branch: the caller chose this token
                token, req.row.forced_token = req.row.forced_token, None
            else:
                if req.constraint is not None:
                    logits = apply_masks(logits.unsqueeze(0), [req.constraint])[0]
                token = self._pick(req, logits)
            entry = None
            if req.out.wants_logprobs:
                entry = self._logprob_entries([req], raw_logits.unsqueeze(0), [token])[0]
            req.accept(token, entry)
        except Exception as exc:  # noqa: BLE001
            logger.exception("stream %s failed", req.writer.stream_id)
            req.fail(exc)

    # -- the batch ------------------------------------------------------------------------------

    def _join(self) -> None:
        """Ready requests join the batch, best first; rows prefilled together join together."""
        ready = []
        free_rows = self.capacity - self._rows_used()
        for req in sorted((r for r in self.waiting if not r.row.needs_prefill and not r.done), key=_rank):
            if req.width > free_rows:
                break
            ready.append(req)
            free_rows -= req.width
        by_cache: dict[int, tuple[RowCache, list[tuple[Any, TextRequest]]]] = {}
        for req in ready:
            rows, index = req.row.own_cache
            by_cache.setdefault(id(rows), (rows, []))[1].append((index, req))
            req.row.own_cache = None
            self.waiting.remove(req)
        for rows, members in by_cache.values():
            # A beam search's index is a list: its prompt row, once per beam.
            indices = [j for i, _ in members for j in (i if isinstance(i, list) else [i])]
            if indices != list(range(rows.rows)):
                rows = rows.select(indices)
            self.rows = rows if self.rows is None else RowCache.concat(self.rows, rows)
            self.batch.extend(req for _, req in members)

    def _decode(self) -> None:
        rows = self.rows
        assert rows is not None
        batch = self.batch
        size = self._rows_used()
        fast = self._fast_decoder()
        spans = rows.spans() if fast is not None and fast.ragged else None
        if spans is None and rows.spans() is not None:
            # transformers' forward (or a fast step without the native stack) needs every row to end
            # at the last column: rows a lookahead step left shorter are moved right (rare: only
            # when the native path was given up after a lookahead step, e.g. a forward patched).
            self.rows = rows = rows.aligned()
        # Drafts (exact lookahead): only where the native step verifies them (`FastDecode.step_ragged`).
        drafts: list[list[int]] = [[] for _ in batch]
        forced = [False] * len(batch)  # a row's drafts are the tokens its grammar forces (not n-gram guesses)
        if spans is not None:
            positions = size  # the step's positions so far: every row's pending token, then drafts
            assert fast is not None  # spans come only from a native ragged step
            for i, req in enumerate(batch):
                look = req.row.lookahead
                if look is None:
                    continue
                room = min(req.spec.max_new_tokens - len(req.row.answer_ids), req.spec.context_length - len(req.row.context)) - 1
                if req.constraint is not None:
                    # Tokens the grammar forces are drafts kept for certain (unless the model spells the
                    # same text in other tokens): no n-gram guess is needed where they exist.
                    drafts[i] = req.constraint.forced(min(room, look.cap))
                    forced[i] = bool(drafts[i])
                if not drafts[i]:
                    drafts[i] = look.drafts(req.row.context, rows=size, room=room, version=req.row.rewinds,
                                            positions=positions, group=fast.row_group)
                    if req.constraint is not None:
                        drafts[i] = req.constraint.admitted(drafts[i])
                positions += len(drafts[i])
        ids: list[int] = []
        places: list[int] = []
        counts: list[int] = []  # positions per row of the cache
        for i, req in enumerate(batch):
            if req.beams is not None:
                for beam in req.beams.running:
                    ids.append(beam[-1])
                    places.append(req.row.prefilled)
                    counts.append(1)
            else:
                ids.append(req.row.context[req.row.prefilled])
                ids.extend(drafts[i])
                places.extend(range(req.row.prefilled, req.row.prefilled + 1 + len(drafts[i])))
                counts.append(1 + len(drafts[i]))
        self._engine_thread = threading.get_ident()
        self._open_for = _ANY if self._poll_arrivals is not None else None
        mask = None
        try:
            if spans is not None:
                assert fast is not None
                points = self._point_layers if self._poll_arrivals is not None else frozenset()
                every = fast.step_ragged(torch.tensor(ids, device=self.device), torch.tensor(places, device=self.device),
                                         rows, spans, counts, points, self._prefill_point,
                                         self._arrival_flag if points else None)
            else:
                input_ids = torch.tensor(ids, device=self.device).unsqueeze(1)
                positions = torch.tensor(places, device=self.device).unsqueeze(1)
                mask = torch.cat([rows.mask, torch.ones(size, 1, dtype=rows.mask.dtype, device=rows.mask.device)], 1)
                every = self._fast_step(fast, input_ids, positions, rows)
                if every is None:
                    every = self._forward(input_ids, mask, positions, rows.cache).logits[:, -1, :]
        except Exception as exc:  # noqa: BLE001 - every row of this batch shares the fault
            logger.exception("a batched decode step failed; ending its %d streams", size)
            for req in batch:
                req.fail(exc)
            self.batch, self.rows = [], None
            return
        finally:
            self._open_for = None
        self.steps += 1
        if mask is not None:
            rows.mask = mask
        # Row r's first position in the step's logits (a row with drafts has several).
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        logits = every
        if len(ids) != size:
            logits = every.index_select(0, torch.tensor(offsets[:-1], device=every.device))
        for i, req in enumerate(batch):
            req.row.decode_steps += 1
            if not drafts[i]:
                req.row.prefilled += 1
        raw_logits = logits
        # Each request takes ``width`` rows of the batch (a beam search one per beam); its first row:
        row_of = [self._first_row(i) for i in range(len(batch))]
        if any(req.constraint is not None and not drafts[i] for i, req in enumerate(batch)):
            # Constrained rows: one mask over the batch's logits; the other rows are untouched.
            logits = apply_masks(logits, [req.constraint if j == 0 and not drafts[i] else None
                                          for i, req in enumerate(batch) for j in range(req.width)])
        greedy = torch.argmax(logits, dim=-1).tolist() if any(r.sampler.plain_greedy for r in batch) else None
        adjusted = self._adjusted([r for i, r in enumerate(batch) if not drafts[i]], logits,
                                  [row_of[i] for i in range(len(batch)) if not drafts[i]],
                                  [i for i in range(len(batch)) if not drafts[i]])
        ended: list[int] = []
        tokens: list[int | None] = [None] * len(batch)
        kept = [1] * len(batch)  # columns each request keeps of those the step wrote
        # The beams' KV rows, reordered after the step: destination rows and their sources.
        moved_to: list[int] = []
        moved_from: list[int] = []
        for i, req in enumerate(batch):
            first = row_of[i]
            try:
                if drafts[i]:
                    kept[i], done = self._verify(req, every[offsets[first]:offsets[first + 1]], drafts[i], forced[i])
                    if done:
                        ended.append(i)
                    continue
                if req.beams is not None:
                    source = req.accept_beams(logits[first:first + req.width])
                    if req.done:
                        ended.append(i)
                    elif source != list(range(req.width)):
                        moved_to.extend(range(first, first + req.width))
                        moved_from.extend(first + s for s in source)
                    continue
                if greedy is not None and req.sampler.plain_greedy:
                    tokens[i] = greedy[first]
                else:
                    tokens[i] = self._pick(req, adjusted.get(i, logits[first]), adjusted=i in adjusted)
            except Exception as exc:  # noqa: BLE001 - a fault in one row's sampling
                logger.exception("stream %s failed", req.writer.stream_id)
                req.fail(exc)
                ended.append(i)
        want = [i for i, req in enumerate(batch) if req.out.wants_logprobs and tokens[i] is not None]
        found: dict[int, dict[str, Any]] = {}
        if want:
            # Logprobs are the model's own (raw logits, before masks and penalties), one pass for all.
            picked = torch.tensor([row_of[i] for i in want], device=raw_logits.device)
            found = dict(zip(want, self._logprob_entries([batch[i] for i in want], raw_logits.index_select(0, picked),
                                                         [tokens[i] for i in want])))  # type: ignore[misc]
        for i, req in enumerate(batch):
            token = tokens[i]
            if token is None:
                continue
            try:
                if req.accept(token, found.get(i)):
                    ended.append(i)
            except Exception as exc:  # noqa: BLE001 - a fault in one row's output
                logger.exception("stream %s failed", req.writer.stream_id)
                req.fail(exc)
                ended.append(i)
        if spans is not None:
            # Each row keeps the columns of what it accepted; the rest is free to be written again.
            keep = [kept[i] for i, req in enumerate(batch) for _ in range(req.width)]
            rows.keep([(start, end + n) for (start, end), n in zip(spans, keep)])
        if moved_to:
            rows.reorder(moved_to, moved_from)
        if ended:
            self._remove_rows(sorted(set(ended)))

    def _verify(self, req: TextRequest, logits: torch.Tensor, drafts: list[int], forced: bool = False) -> tuple[int, bool]:
        """A request's tokens from one step that verified its ``drafts``: ``logits`` (one row per
        position: its pending token, then each draft) give its tokens one at a time, each chosen as
        a one-token step would choose it (its grammar, penalties and seeded draw at that output
        position, all as they stand after the tokens before it); drafts are kept while they equal
        what was chosen, and the token after the last one kept ends the block. Returns the columns
        the row keeps (its pending token and the drafts kept) and whether the request ended.
        ``forced``: the drafts are its grammar's forced tokens (counted apart from the n-gram rates)."""
        accepted = 0
        done = False
        for j in range(len(drafts) + 1):
            raw = logits[j]
            row = apply_masks(raw.unsqueeze(0), [req.constraint])[0] if req.constraint is not None else raw
            token = self._pick(req, row)
            entry = self._logprob_entries([req], raw.unsqueeze(0), [token])[0] if req.out.wants_logprobs else None
            done = req.accept(token, entry, hold=True)
            match = j < len(drafts) and token == drafts[j]
            accepted += match
            if done or not match:
                break
        assert req.row.lookahead is not None
        if forced:  # the grammar's drafts: in the metrics, not in the n-gram acceptance rates
            req.row.lookahead.counted(len(drafts), accepted)
        else:
            req.row.lookahead.verified(len(drafts), accepted)
        req.row.prefilled += accepted + 1
        req.release()
        return accepted + 1, done

    def _fast_decoder(self) -> FastDecode | None:
        """`FastDecode` for this step (quantized Llama-family models), or None to take the model's forward."""
        if not self._fast_checked:
            self._fast_checked = True
            self._fast = FastDecode.for_model(self.model)
        if self._fast is None or not self._mergeable or _forward_replaced(self.model):
            return None
        return self._fast

    def _fast_step(self, fast: FastDecode | None, input_ids: torch.Tensor, positions: torch.Tensor,
                   rows: RowCache) -> torch.Tensor | None:
        """The decode through ``fast`` (left-padded rows, one token each), or None to take the model's forward."""
        if fast is None:
            return None
        starts = _left_padding(rows.mask)
        if starts is None:
            return None
        points = self._point_layers if self._poll_arrivals is not None else frozenset()
        return fast.step(input_ids, positions, rows, starts if len(starts) > 1 or starts[0] else None,
                         points, self._prefill_point, self._arrival_flag if points else None)

    # -- choosing tokens ------------------------------------------------------------------------

    def _penalties(self, req: TextRequest, logits: torch.Tensor) -> Penalties:
        sampler = req.sampler
        if sampler.penalties is None:
            sampler.penalties = Penalties(sampler.plan, int(logits.shape[-1]), logits.device)
        sampler.penalties.sync(req.row.answer_ids, req.row.rewinds)
        return sampler.penalties

    def _adjusted(self, batch: list[TextRequest], logits: torch.Tensor, row_of: list[int],
                  keys: list[int]) -> dict[int, torch.Tensor]:
        """OpenAI's penalties and logit biases for every request that has them, in one expression
        (``row_of[i]``: request ``i``'s row of ``logits``; the result is keyed by ``keys[i]``)."""
        rows = [i for i, req in enumerate(batch) if req.sampler.plan.adjusts]
        if not rows:
            return {}
        index = torch.tensor([row_of[i] for i in rows], device=logits.device)
        out = adjust_rows(logits.index_select(0, index), [self._penalties(batch[i], logits) for i in rows])
        return {keys[i]: out[j] for j, i in enumerate(rows)}

    def _pick(self, req: TextRequest, logits: torch.Tensor, *, adjusted: bool = False) -> int:
        if req.sampler.plain_greedy:
            return int(torch.argmax(logits))
        if req.sampler.plan.adjusts and not adjusted:
            logits = adjust_rows(logits.unsqueeze(0), [self._penalties(req, logits)])[0]
        if req.sampler.plan.greedy and req.sampler.plan.repetition_penalty == 1.0:
            return int(torch.argmax(logits))
        return req.sampler.pick(logits, req.row.context, req.row.output_position, req.row.answer_ids)

    def _logprob_entries(self, reqs: list[TextRequest], logits: torch.Tensor, tokens: list[int]) -> list[dict[str, Any]]:
        """Logprob entries of each row's chosen token: one log-softmax over the rows' raw logits in
        fp32, one top-k at the largest k asked, one move to the CPU."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1))
        k = max(req.out.top_logprobs for req in reqs)
        if k > 0:
            top_values, top_ids = logprobs.topk(k, dim=-1)
            numbers = torch.cat([chosen, top_values], 1).clamp_min(_LOGPROB_FLOOR).tolist()
            ids = top_ids.tolist()
        else:
            numbers = chosen.clamp_min(_LOGPROB_FLOOR).tolist()
            ids = [[] for _ in reqs]
        out = []
        for req, token, row, row_ids in zip(reqs, tokens, numbers, ids):
            kk = req.out.top_logprobs
            out.append(entries(req.out.token_table, token, row[0], row_ids[:kk], row[1 : 1 + kk]))
        return out

    def score(self, ids: list[int], table: TokenTable, top_logprobs: int) -> list[dict[str, Any] | None]:
        """Logprob entries of a prompt's own tokens (the first is None: nothing predicts it), from
        one forward of the whole prompt. Call on the engine thread (`Engine.run_on_engine`)."""
        out: list[dict[str, Any] | None] = [None]
        if len(ids) < 2:
            return out
        result = self._call(input_ids=torch.tensor([ids], device=self.device), use_cache=True,
                            **{self._cache_arg: self._empty_cache()})
        logits = result.logits[0, :-1]
        # Bounded memory: log-softmax a few hundred positions at a time.
        for start in range(0, logits.shape[0], 256):
            part = logits[start : start + 256]
            tokens = ids[start + 1 : start + 1 + part.shape[0]]
            logprobs = torch.log_softmax(part.float(), dim=-1)
            chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1))
            if top_logprobs:
                values, top = logprobs.topk(top_logprobs, dim=-1)
                numbers = torch.cat([chosen, values], 1).clamp_min(_LOGPROB_FLOOR).tolist()
                top_ids = top.tolist()
            else:
                numbers, top_ids = chosen.clamp_min(_LOGPROB_FLOOR).tolist(), [[] for _ in tokens]
            for token, row, row_ids in zip(tokens, numbers, top_ids):
                out.append(entries(table, token, row[0], row_ids, row[1:]))
        return out
