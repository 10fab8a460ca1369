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

import inspect
import logging
import threading
import weakref
from itertools import count
from typing import Any, Callable

import torch

from ._fast_decode import PREFILL_POINTS, FastDecode
from ._kv_rows import RowCache, supports_row_cache
from ._request import TextRequest
from ._row_attention import uses_row_attention

__all__ = ["TextBatcher"]

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


def _returned_cache(out: Any, name: str, given: Any) -> Any:
    returned = out[name]
    return given if returned is None else returned


def _left_padding(mask: torch.Tensor) -> list[int] | None:
    """Each row's padding columns, if every row is padding then tokens (None otherwise)."""
    first = mask.to(torch.int8).argmax(1)
    if not bool(torch.equal(mask.sum(1).to(first.dtype), mask.shape[1] - first)):
        return None
    return [int(i) for i in first.tolist()]


def _rank(req: TextRequest) -> tuple[int, int]:
    """Sort key: higher priority first, then first come first served."""
    return (-req.priority, req.order)


class TextBatcher:
    """The engine backend of a causal LM (see the module docstring for one step)."""

    def __init__(self, model: Any, *, max_batch: int = 16, prefill_budget: int = 512) -> None:
        self.model = model
        self.max_batch = max_batch
        self.prefill_budget = prefill_budget
        self.device = next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        # transformers 5.2x renamed `past_key_values` to `cache`; speak whichever this model knows.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._mergeable: bool | None = None  # known after the first prefill
        self.waiting: list[TextRequest] = []
        self.batch: list[TextRequest] = []
        self.rows: RowCache | None = None
        self._arrivals = count()
        self.steps = 0  # decode steps run (tests and benchmarks read it)
        self.prefills_inside_steps = 0  # newcomers prefilled at a prefill point (tests read it)
        self._poll_arrivals: Callable[[], int] | None = None
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

    # -- Backend --------------------------------------------------------------------------------

    def admit(self, request: TextRequest) -> None:
        request.order = next(self._arrivals)
        self.waiting.append(request)

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

    def enable_prefill_points(self, poll_arrivals: Callable[[], int]) -> None:
        """Prefill newcomers part-way through a decode forward (see the module docstring).

        ``poll_arrivals`` (the engine's `Engine.poll_arrivals`) admits what arrived since the step
        began. Models whose decoder layers cannot be found keep prefilling at step boundaries only.
        """
        layers = _decoder_layers(self.model)
        if not layers or self._hooks:
            return
        self._poll_arrivals = poll_arrivals
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
        try:
            self._guarded(self._prefill_group, group)  # closes the points for its own forward
            self.prefills_inside_steps += sum(1 for r in group if not r.needs_prefill)
        finally:
            self._open_for, self._prefilling = open_for, outer
        self.waiting = [r for r in self.waiting if not r.done]

    def _newcomers_to_prefill_now(self, open_for: tuple[float, float]) -> list[TextRequest]:
        """Fresh whole prompts (one priority, within what is left of this step's prefill budget,
        ranked before ``open_for``) that will get a row at the next step boundary: a free one, or
        one that `_make_room_for_priority` takes from a lower-ranked running request (one each)."""
        ready = sum(1 for r in self.waiting if not r.needs_prefill and not r.done)
        free_rows = self.capacity - len(self.batch) - ready - len(self._prefilling)
        # Rows a newcomer can take by pausing a running request, worst first (a cache that cannot
        # be split gives none).
        victims = sorted((_rank(r) for r in self.batch), reverse=True) if self._mergeable else []
        group: list[TextRequest] = []
        for req in sorted(self.waiting, key=_rank):
            if req.done or not req.needs_prefill or req in self._prefilling or req.check_flags():
                continue
            fresh = req.prefilled == 0 and req.own_cache is None and len(req.context) <= self._budget_left
            if not fresh or _rank(req) >= open_for or (group and req.priority != group[0].priority):
                break
            if free_rows > 0:
                free_rows -= 1
            elif victims and _rank(req) < victims[0]:
                victims.pop(0)
            else:
                break
            group.append(req)
            self._budget_left -= len(req.context)
        return group

    # -- capacity -------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Rows per step: ``max_batch``, or 1 for caches that cannot be split (sliding windows)."""
        return self.max_batch if self._mergeable is not False else 1

    def _drop_ended(self) -> None:
        for req in self.waiting:
            req.check_flags()
        self.waiting = [r for r in self.waiting if not r.done]
        ended = [i for i, req in enumerate(self.batch) if req.check_flags()]
        if ended:
            self._remove_rows(ended)

    def _remove_rows(self, indices: list[int]) -> None:
        gone = set(indices)
        keep = [i for i in range(len(self.batch)) if i not in gone]
        self.batch = [self.batch[i] for i in keep]
        if not keep or self.rows is None:
            self.rows = None
        elif self._mergeable:
            self.rows = self.rows.select(keep)

    def _apply_edits(self) -> None:
        """Steers and rewinds: the row leaves the batch with its cache, cut back as the edit says,
        and rejoins after its new tokens are prefilled (only those: the rest stays cached)."""
        edited = [i for i, req in enumerate(self.batch) if req.has_edits]
        if edited:
            assert self.rows is not None
            for i in edited:
                self.batch[i].own_cache = (self.rows.select([i]), 0) if self._mergeable else (self.rows, 0)
            moved = [self.batch[i] for i in edited]
            self._remove_rows(edited)
            self.waiting.extend(moved)
        for req in self.waiting:
            if not req.has_edits or req.done:
                continue
            own: RowCache | None = None
            if req.own_cache is not None:
                rows, index = req.own_cache
                own = rows if rows.rows == 1 else rows.select([index])
            for edit in req.take_edits():
                keep = req.apply_edit(edit)
                if own is not None:
                    own = own.crop(keep) if keep > 0 else None
            req.own_cache = (own, 0) if own is not None else None
            if own is None:
                req.prefilled = 0

    def _make_room_for_priority(self) -> None:
        """Pause the lowest-ranked running rows while better-ranked requests wait for a row."""
        if not self._mergeable or not self.waiting:
            return
        waiting = sorted(self.waiting, key=_rank)
        while len(self.batch) >= self.capacity and waiting:
            worst = max(range(len(self.batch)), key=lambda i: _rank(self.batch[i]))
            if _rank(waiting[0]) >= _rank(self.batch[worst]):
                return
            paused = self.batch[worst]
            assert self.rows is not None
            paused.own_cache = (self.rows.select([worst]), 0)
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
        budget = self._budget_left
        free_rows = self.capacity - len(self.batch)
        group: list[TextRequest] = []
        for req in sorted(self.waiting, key=_rank):
            if free_rows <= 0 or budget <= 0:
                break
            if not req.needs_prefill:
                free_rows -= 1  # paused earlier, its cache is ready: it takes a row first
                continue
            remaining = len(req.context) - req.prefilled
            if group and req.priority != group[0].priority:
                break  # a higher priority is prefilled on its own, so its first token is not held up
            if req.prefilled == 0 and req.own_cache is None and remaining <= budget:
                group.append(req)
                budget -= remaining
                free_rows -= 1
            elif not group:
                self._guarded(self._prefill_chunk, [req], min(budget, remaining))
                budget = 0
        self._budget_left = budget
        if group:
            self._guarded(self._prefill_group, group)
        self.waiting = [r for r in self.waiting if not r.done]

    def _guarded(self, fn: Any, reqs: list[TextRequest], *args: Any) -> None:
        try:
            fn(reqs, *args)
        except Exception as exc:  # noqa: BLE001 - these requests fail; the others go on
            logger.exception("prefill failed for %d stream(s)", len(reqs))
            for req in reqs:
                req.fail(exc)

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        extra: dict[str, Any] = {self._cache_arg: cache}
        if mask.shape[0] > 1 and uses_row_attention(self.model):
            starts = _left_padding(mask)
            if starts is not None:
                extra["row_starts"] = starts  # each row attends to its own columns only (_row_attention)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **extra,
        )
        returned = out[self._cache_arg]
        if self._mergeable is None:
            self._mergeable = supports_row_cache(returned if returned is not None else cache)
        return out

    def _prefill_group(self, group: list[TextRequest]) -> None:
        from transformers import DynamicCache

        if len(group) > 1 and self._mergeable is False:
            group = group[:1]
        width = max(len(r.context) for r in group)
        ids, mask, positions = [], [], []
        for req in group:
            pad = width - len(req.context)
            ids.append([req.context[0]] * pad + req.context)
            mask.append([0] * pad + [1] * len(req.context))
            positions.append([0] * pad + list(range(len(req.context))))
        cache = DynamicCache()
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
        rows = RowCache(_returned_cache(out, self._cache_arg, cache), mask_t)
        for i, req in enumerate(group):
            req.prefilled = len(req.context)
            req.own_cache = (rows, i)
            self._first_token(req, out.logits[i, -1])

    def _prefill_chunk(self, reqs: list[TextRequest], n: int) -> None:
        from transformers import DynamicCache

        (req,) = reqs
        start = req.prefilled
        ids = req.context[start : start + n]
        cache = req.own_cache[0].cache if req.own_cache is not None else DynamicCache()
        mask = torch.ones(1, start + n, dtype=torch.long, device=self.device)
        out = self._forward(
            torch.tensor([ids], device=self.device), mask,
            torch.arange(start, start + n, device=self.device).unsqueeze(0), cache,
        )
        req.own_cache = (RowCache(_returned_cache(out, self._cache_arg, cache), mask), 0)
        req.prefilled += n
        if req.prefilled >= len(req.context):
            self._first_token(req, out.logits[0, -1])

    def _first_token(self, req: TextRequest, logits: torch.Tensor) -> None:
        # The first token goes out now: time to first token is queueing plus prefill.
        req.needs_prefill = False
        try:
            req.accept(self._pick(req, logits))
        except Exception as exc:  # noqa: BLE001
            logger.exception("stream %s failed", req.writer.stream_id)
            req.fail(exc)

    # -- the batch ------------------------------------------------------------------------------

    def _join(self) -> None:
        """Ready requests join the batch, best first; rows prefilled together join together."""
        ready = sorted((r for r in self.waiting if not r.needs_prefill and not r.done), key=_rank)
        ready = ready[: max(0, self.capacity - len(self.batch))]
        by_cache: dict[int, tuple[RowCache, list[tuple[int, TextRequest]]]] = {}
        for req in ready:
            rows, index = req.own_cache
            by_cache.setdefault(id(rows), (rows, []))[1].append((index, req))
            req.own_cache = None
            self.waiting.remove(req)
        for rows, members in by_cache.values():
            indices = [i for i, _ in members]
            if indices != list(range(rows.rows)):
                rows = rows.select(indices)
            self.rows = rows if self.rows is None else RowCache.concat(self.rows, rows)
            self.batch.extend(req for _, req in members)

    def _decode(self) -> None:
        rows = self.rows
        assert rows is not None
        batch = self.batch
        size = len(batch)
        input_ids = torch.tensor([[req.context[req.prefilled]] for req in batch], device=self.device)
        positions = torch.tensor([[req.prefilled] for req in batch], device=self.device)
        mask = torch.cat([rows.mask, torch.ones(size, 1, dtype=rows.mask.dtype, device=rows.mask.device)], 1)
        self._engine_thread = threading.get_ident()
        self._open_for = _ANY if self._poll_arrivals is not None else None
        try:
            logits = self._fast_step(input_ids, positions, rows)
            if logits is None:
                logits = self._forward(input_ids, mask, positions, rows.cache).logits[:, -1, :]
        except Exception as exc:  # noqa: BLE001 - every row of this batch shares the fault
            logger.exception("a batched decode step failed; ending its %d streams", size)
            for req in batch:
                req.fail(exc)
            self.batch, self.rows = [], None
            return
        finally:
            self._open_for = None
        self.steps += 1
        rows.mask = mask
        for req in batch:
            req.prefilled += 1
        greedy = torch.argmax(logits, dim=-1).tolist() if any(r.sampler.plain_greedy for r in batch) else None
        ended: list[int] = []
        for i, req in enumerate(batch):
            try:
                token = greedy[i] if greedy is not None and req.sampler.plain_greedy else self._pick(req, logits[i])
                if req.accept(token):
                    ended.append(i)
            except Exception as exc:  # noqa: BLE001 - a fault in one row's sampling or output
                logger.exception("stream %s failed", req.writer.stream_id)
                req.fail(exc)
                ended.append(i)
        if ended:
            self._remove_rows(ended)

    def _fast_step(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: RowCache) -> torch.Tensor | None:
        """The decode through `FastDecode` (quantized Llama-family models), or None to take the model's forward."""
        if not self._fast_checked:
            self._fast_checked = True
            self._fast = FastDecode.for_model(self.model)
        # A forward replaced on the instance (a wrapper, accelerate's hooks, a test's spy) is the user's
        # say in what a step runs: respect it.
        if self._fast is None or not self._mergeable or "forward" in vars(self.model):
            return None
        starts = _left_padding(rows.mask)
        if starts is None:
            return None
        points = self._point_layers if self._poll_arrivals is not None else frozenset()
        return self._fast.step(input_ids, positions, rows, starts if len(starts) > 1 or starts[0] else None,
                               points, self._prefill_point)

    def _pick(self, req: TextRequest, logits: torch.Tensor) -> int:
        if req.sampler.plain_greedy:
            return int(torch.argmax(logits))
        return req.sampler.pick(logits, req.context, req.output_position, req.answer_ids)
