"""The scheduler: continuous batching under one row budget per forward pass.

Each `schedule()` first serves running requests (decodes with drafts to verify,
prefill continuations), then admits waiting ones in queue order. Every request gets
the largest chunk whose rows fit the target pass and each drafter pass together
(`budget.plan_chunk`); KV slots come after, preempting the lowest-priority running
request (the newest under FCFS) when the pool is short.
"""

from __future__ import annotations

import numpy as np

from scheduler.budget import (
    RequestView,
    ThrottleRule,
    TreeDepthRule,
    check_budget_config,
    plan_chunk,
)
from scheduler.bulk_plan import RunningCounters, plan_bulk
from scheduler.config import CacheConfig, GoodputSettings, SchedulerConfig
from scheduler.goodput import GoodputPolicy
from scheduler.kv_cache_manager import KVCacheBlock, KVCacheManager
from scheduler.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    check_runner_output,
)
from scheduler.request import NUM_OUTCOMES, Request, RequestStatus
from scheduler.request_queue import make_queue
from scheduler.stats import SchedulerStats
from scheduler.step_output import build_output
from scheduler.step_record import StepRecord
from scheduler.update import append_tokens, check_shadow, count_accepted, in_schedule_order
from spec_decode import SpeculativeConfig


class Scheduler:
    """Decides each step's batch; see DESIGN.md §2 for the budget rule."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 speculative_config: SpeculativeConfig | None = None,
                 rule: ThrottleRule | None = None,
                 goodput: GoodputSettings | None = None) -> None:
        """`goodput`: the goodput policy's settings (defaults if None), e.g. the
        acceptance a trained head was measured at, as its prior."""
        self.config = scheduler_config
        self.cache_config = cache_config
        self.speculative_config = speculative_config
        self.method = speculative_config.spec_method if speculative_config else None
        max_k = speculative_config.num_speculative_tokens if speculative_config else 0
        adaptive = speculative_config is not None and speculative_config.draft_policy == "fit"
        self.rule = rule or ThrottleRule(self.method, max_k, scheduler_config.max_model_len,
                                         adaptive, bool(speculative_config
                                                        and speculative_config.parks))
        check_budget_config(self.rule, speculative_config, scheduler_config.max_num_batched_tokens)
        # A drafted tree (spec_decode/tree_shape.py), None for chains: the goodput policy
        # then prices and learns by depth, and its caps are the nodes to that depth.
        shape = speculative_config.tree_shape if speculative_config else None
        self.tree = None if shape is None or shape.is_chain else shape
        policy_rule = self.rule if self.tree is None else TreeDepthRule(self.rule, self.tree)
        # draft_policy="goodput": a cap on each request's k per step (scheduler/goodput.py).
        self.policy = (GoodputPolicy(policy_rule, scheduler_config.max_num_batched_tokens,
                                     goodput)
                       if speculative_config is not None
                       and speculative_config.draft_policy == "goodput" else None)
        # Parked requests' drafts proposed anyway, where proposing costs no rows: at
        # most this many a step (0: none), in turn (`_shadow_turn`).
        self.max_shadows = (self.policy.settings.max_shadows
                        if self.policy is not None and self.method is not None
                        and self.method.shadows else 0)
        self._shadow_turn = 0
        self.kv = KVCacheManager(cache_config)
        # The bulk plan takes the running requests that take their whole chunk in one
        # numpy pass, whenever the rule is tabled; False plans every request with
        # `plan_chunk` (the reference, for tests).
        self.plan_in_bulk = True
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._predicted_seconds: float | None = None  # of the step last planned
        # Of the step last planned: rows that give logits, and the drafter's passes.
        self._logit_rows = 0
        # ... the drafter's passes other than a chain's one-row steps (the fit reads the
        # one-row steps the chains ran, the prediction the ones the policy priced), and
        # whether the drafter runs such steps.
        self._base_passes = 0
        self._chained = False
        self._step_record: StepRecord | None = None  # built on the first step
        self._finished_since_last_step: set[str] = set()
        # Set by a caller that holds every request it will add (offline `generate`):
        # once nothing waits, the batch only drains, and the goodput policy plans k to
        # finish it soonest. A server never knows that, so it stays False there.
        self.arrivals_closed = False

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; refuse one that could never run, naming the limit."""
        self._validate(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _validate(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"request {rid!r}: prompt_token_ids is empty")
        max_len = self.config.max_model_len
        if num_prompt >= max_len:
            raise ValueError(
                f"request {rid!r}: prompt of {num_prompt} tokens leaves no room to "
                f"generate within max_model_len={max_len} (the prompt must be < {max_len})"
            )
        # The most KV this request can ever hold, drafts and lookahead included.
        need = self.kv.blocks_needed(self.max_slots(num_prompt, request.max_tokens))
        if need > self.cache_config.num_blocks:
            raise ValueError(
                f"request {rid!r} may need {need} KV blocks (prompt {num_prompt} + "
                f"max_tokens {request.max_tokens}), more than the cache's "
                f"num_blocks={self.cache_config.num_blocks}"
            )

    def max_slots(self, num_prompt: int, max_tokens: int) -> int:
        """The most KV slots a request ever holds: every position of its longest
        sequence but the last (whose token is sampled, never computed). Drafts and the
        drafter's lookahead (at most k + 1 slots past the chunk) stay inside it: the k
        rule leaves room for k + 2 more tokens within both limits. So a method that
        drafts holds no more than speculation off (tests/scheduler/test_state_machine.py checks
        every request's blocks against it)."""
        return min(self.config.max_model_len, num_prompt + max_tokens) - 1

    def max_request_blocks(self) -> int:
        """KV blocks one request may hold at most (what the pool must hold to serve any
        request the context length allows)."""
        return self.kv.blocks_needed(self.max_slots(self.config.max_model_len, 0))

    def abort_request(self, request_id: str,
                      status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Stop a request now and free everything it holds; unknown ids are ignored.
        `status` FINISHED_ERROR: the engine traced a failed step to this request."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)

    def requeue(self, request_id: str, suspect: bool) -> None:
        """Preempt a request outside a step (its step failed, so its KV and drafts are
        not to be trusted): recompute it from its known tokens, outputs kept."""
        request = self.requests[request_id]
        if request.status == RequestStatus.RUNNING:
            self._recompute_later(request)
        request.suspect = suspect

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if self.policy is not None:
            self.policy.observe_finished(request.verifications_by_state,
                                         request.num_first_accepted)
            self.stats.goodput.request_weight = self.policy.acceptance.spread.weight
        request.spec_token_ids = []
        request.shadow_token_id = None
        self.kv.free(request, finished=True)
        del self.requests[request.request_id]
        self._finished_since_last_step.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def kv_cache_usage(self) -> float:
        return self.kv.usage()

    # ---- one step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones in order."""
        record = self._record()
        preempted: set[str] = set()
        self._schedule_running(record, preempted)
        if not preempted:
            self._schedule_waiting(record)
        return self._apply(record, preempted)

    def _record(self) -> StepRecord:
        """The step record, reset; built again only if the rule was swapped."""
        record = self._step_record
        if record is None or record.rule is not self.rule:
            record = StepRecord(self.rule, self.config.max_num_batched_tokens,
                                self.config.max_num_seqs)
            self._step_record = record
        record.reset()
        return record

    def _view(self, request: Request, max_drafts: int,
              cached: tuple[int, int] | None = None) -> RequestView:
        """A running request's counters; `cached`: a waiting one's cached prefix, and
        how much of it its drafter holds (`_usable_prefix`)."""
        computed, drafter = (cached if cached is not None
                             else (request.num_computed_tokens, request.num_drafter_computed))
        return RequestView(
            num_computed_tokens=computed,
            num_tokens=request.num_tokens,
            num_spec_tokens=len(request.spec_token_ids),
            num_output_tokens=request.num_output_tokens,
            max_tokens=request.max_tokens,
            max_drafts=max_drafts,
            num_drafter_computed=drafter,
        )

    def _usable_prefix(self, prefix: list[KVCacheBlock]) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks a new request takes, and the tokens of them its drafter
        holds. Under a method that parks, a block filled while its request was parked
        holds target KV only: the new request's drafter catches it up in its first
        chunk (from the feature cache), so at most B / 2 such tokens are taken and the
        rest is computed again."""
        size = self.kv.block_size
        if not self.rule.parks:
            return prefix, len(prefix) * size
        held = next((i for i, block in enumerate(prefix) if not block.drafter_computed),
                    len(prefix))
        stale = self.config.max_num_batched_tokens // 2 // size
        return prefix[:held + stale], held * size

    def _max_chunk(self, num_pending: int) -> int:
        # Without chunked prefill a prompt goes whole, so the threshold cannot apply.
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0 and self.config.enable_chunked_prefill:
            return min(num_pending, threshold)
        return num_pending

    def _schedule_running(self, record: StepRecord, preempted: set[str]) -> None:
        running = list(self.running)  # a copy: preemption edits the list
        counters = (RunningCounters.gather(running, self.kv.req_blocks)
                    if running and (self.plan_in_bulk or self.policy) else None)
        caps = self._draft_caps(counters)
        bulk = self._plan_bulk(record, counters, caps)
        for i in range(bulk, len(running)):
            request = running[i]
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room
            view = self._view(request, int(caps[i]) if caps is not None else self.rule.max_k)
            pending = request.num_tokens_with_spec - request.num_computed_tokens
            plan = plan_chunk(self.rule, record.remaining, view, self._max_chunk(pending),
                              allow_partial=True)
            if plan is None:
                continue
            held = len(self.kv.req_blocks.get(request.request_id, ()))
            while not self.kv.allocate_slots(request, plan.num_tokens, plan.lookahead):
                victim = self._pick_victim()
                self._preempt(victim, record, preempted)
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                record.append(request, plan, held, self._num_blocks(request) - held)
        if record.num_refunds:
            self._offer_refunds(record, caps, running)

    def _draft_caps(self, counters: RunningCounters | None) -> np.ndarray | None:
        """The goodput policy's k cap per running request (None: the rule's k)."""
        if self.policy is None:
            return None
        if counters is None:  # nothing running: only the cap of a fresh request matters
            empty = np.zeros(0, dtype=np.int64)
            self.policy.caps(np.zeros((0, NUM_OUTCOMES), dtype=np.int64), empty, empty, empty)
            return None
        c = counters
        closed = self.arrivals_closed and not self.waiting
        if self.policy.holding(len(c.num_tokens), closed):
            return self._nodes(self.policy.hold())  # a decision that drafted nothing, kept
        s = c.num_spec  # verified next if the whole chunk fits (the bulk plan's case)
        rule_k = self.rule.k(c.num_tokens, c.num_output, c.max_tokens, s)
        # What each may still make; a closed batch plans on it.
        left = np.minimum(c.max_tokens - c.num_output, self.config.max_model_len - c.num_tokens)
        return self._nodes(self.policy.caps(
            c.verifications, c.first_accepted, c.last_outcome, self._depth(rule_k), c.behind,
            remaining=left if closed else None, unverified=c.unverified,
            produced=c.num_output, left=left))

    def _depth(self, k: np.ndarray) -> np.ndarray:
        """Drafts counted as the goodput policy counts them: a tree's by depth."""
        return k if self.tree is None else self.tree.depth(k)

    def _nodes(self, caps: np.ndarray) -> np.ndarray:
        """The policy's caps as drafts to charge: a tree's nodes to that depth."""
        return caps if self.tree is None else self.tree.nodes(caps)

    def _num_blocks(self, request: Request) -> int:
        return len(self.kv.req_blocks.get(request.request_id, ()))

    def _plan_bulk(self, record: StepRecord, counters: RunningCounters | None,
                   caps: np.ndarray | None) -> int:
        """Plan, charge and give KV to the leading running requests that take their
        whole chunk (scheduler/bulk_plan.py); return how many. The loop does the rest."""
        if not (self.plan_in_bulk and counters is not None and self.rule.tables is not None):
            return 0
        threshold = (self.config.long_prefill_token_threshold
                     if self.config.enable_chunked_prefill else 0)
        count = plan_bulk(record, self.running, counters, self.kv.pool.num_free_blocks,
                          self.kv.block_size, threshold, caps)
        self.kv.append_blocks(self.running[:count], record.new_blocks[:count])
        return count

    def _offer_refunds(self, record: StepRecord, caps: np.ndarray | None,
                       running: list[Request]) -> None:
        """Under priority a victim may be preempted after requests behind it were
        planned with the rows it held: offer the refund back to each, in order. A
        larger chunk is taken only if the KV pool holds it without preempting more."""
        cap_of = ({r.request_id: int(c) for r, c in zip(running, caps.tolist())}
                  if caps is not None else {})
        for i in np.flatnonzero(record.live[:record.count]).tolist():
            request = record.requests[i]
            old = record.refund(i)
            pending = request.num_tokens_with_spec - request.num_computed_tokens
            view = self._view(request, cap_of.get(request.request_id, self.rule.max_k))
            plan = plan_chunk(self.rule, record.remaining, view,
                              self._max_chunk(pending), allow_partial=True)
            if plan is None or plan.num_tokens <= old.num_tokens or not \
                    self.kv.allocate_slots(request, plan.num_tokens, plan.lookahead):
                plan = old
            record.restore(i, plan, self._num_blocks(request) - int(record.held_blocks[i]))

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, record: StepRecord, preempted: set[str]) -> None:
        """Recompute-style preemption: free its blocks, refund its charge, requeue."""
        row = record.index(request.request_id)
        if row is not None:
            record.refund(row)
        self._recompute_later(request)
        preempted.add(request.request_id)

    def _recompute_later(self, request: Request) -> None:
        """Take a running request out: free its blocks, drop its drafts, queue it to be
        recomputed from its known tokens ahead of newer arrivals."""
        self.running.remove(request)
        self.kv.free(request, finished=False)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = request.num_drafter_computed = 0
        request.spec_token_ids = []
        request.shadow_token_id = None
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.readd_preempted(request)

    def _schedule_waiting(self, record: StepRecord) -> None:
        """Admit from the head of the queue until one does not fit (no skipping).

        At most one suspect (`Request.suspect`) runs at a time, so a step that fails
        again is traced to it; a second suspect waits, and so does everyone behind it.
        """
        suspect_in_step: bool | None = None  # looked up only when a suspect is next
        while len(self.waiting) and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.suspect:
                if suspect_in_step is None:
                    suspect_in_step = any(r.suspect for r in self.running)
                if suspect_in_step:
                    break
                suspect_in_step = True
            prefix, drafter_cached = self._usable_prefix(self.kv.find_prefix(request))
            num_cached = len(prefix) * self.kv.block_size
            cap = (int(self._nodes(np.array(self.policy.admission_cap())))
                   if self.policy else self.rule.max_k)
            view = self._view(request, cap, (num_cached, drafter_cached))
            plan = plan_chunk(self.rule, record.remaining, view,
                              self._max_chunk(request.num_tokens - num_cached),
                              allow_partial=self.config.enable_chunked_prefill)
            if plan is None:
                break
            if not self.kv.allocate_slots(request, plan.num_tokens, plan.lookahead, prefix):
                break
            self.waiting.pop()
            request.num_computed_tokens = num_cached
            request.num_drafter_computed = drafter_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            record.append(request, plan, 0, self._num_blocks(request), admitted=True)
            self.stats.num_prefix_hit_tokens += num_cached

    def _apply(self, record: StepRecord, preempted: set[str]) -> SchedulerOutput:
        """Commit the record: advance computed counts, drop drafts that did not fit.

        Running requests are reported as cached with their computed count before the
        step and the blocks given this step; admitted ones (the record's last rows) as
        new."""
        live = record.live_rows()
        requests = record.requests if isinstance(live, slice) else \
            [record.requests[i] for i in live.tolist()]
        num_running = len(requests) - record.num_admitted
        new_reqs = [self._new_request_data(r) for r in requests[num_running:]]
        req_ids = [r.request_id for r in requests]
        spec_tokens: dict[str, list[int]] = {}
        # A request's drafter follows its chunk unless parked (it samples with k = 0):
        # then it holds what it held, and the gap waits for its next draft.
        parked = ((record.samples[live] & (record.num_draft_tokens[live] == 0)).tolist()
                  if self.rule.parks else [False] * len(requests))
        catch_up = 0
        for request, n, s, park in zip(requests, record.num_tokens[live].tolist(),
                                       record.num_spec[live].tolist(), parked):
            spec = request.spec_token_ids
            if len(spec) > s:  # a chunk cut short by the budget or the threshold
                del spec[s:]
            if s:
                spec_tokens[request.request_id] = list(spec)
            if not park:  # rejected drafts roll both back (update_from_output)
                catch_up += request.num_computed_tokens - request.num_drafter_computed
                request.num_drafter_computed = request.num_computed_tokens + n
            request.num_computed_tokens += n
        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        output = build_output(record, req_ids, new_reqs, self._cached(record, req_ids, num_running),
                              spec_tokens, preempted, finished, self.max_shadows,
                              self._shadow_turn)
        self._shadow_turn += len(output.shadow_req_ids)
        self.stats.record_step(output)
        self.stats.goodput.catch_up_rows += catch_up
        if self.policy is not None:
            self._predict_seconds(record, output)
        return output

    def _cached(self, record: StepRecord, req_ids: list[str],
                num_running: int) -> CachedRequestData:
        """The running rows: computed counts before the step, blocks given this step."""
        live = record.live_rows()
        held = record.held_blocks[live][:num_running]
        new_ids: list[list[int]] = [[]] * num_running  # shared: the runner only reads it
        for i in np.flatnonzero(record.new_blocks[live][:num_running]).tolist():
            new_ids[i] = self.kv.block_ids(req_ids[i], int(held[i]))
        return CachedRequestData(req_ids[:num_running], new_ids,
                                 record.num_computed[live][:num_running].tolist())

    def _teach_policy(self, out: SchedulerOutput, result: ModelRunnerOutput,
                      verified: list[int], accepted: list[int], states: list[int],
                      produced: list[int]) -> None:
        """The goodput policy learns from each step: its verifications, and its time
        against the rows the runner built (as charged, if it reported none)."""
        assert self.policy is not None
        rows = result.pass_rows or out.pass_rows
        target = rows.get("target", 0)
        drafter = sum(rows.values()) - target
        passes = self._base_passes
        if self._chained:  # the one-row steps run: the longest chain's drafts past its first
            longest = max(map(len, result.draft_token_ids.values()), default=0)
            passes += max(int(self._depth(np.array(longest))) - 1, 0)
        if self.tree is not None:  # learnt by depth: a tree accepts a token a depth
            verified = self.tree.depth(np.array(verified, dtype=np.int64)).tolist()
        self.policy.observe_step(verified, accepted, states,
                                 (target, self._logit_rows, drafter, passes),
                                 result.step_seconds, produced, result.drafter_seconds)
        if result.step_seconds is not None and self._predicted_seconds is not None:
            self.stats.goodput.record_time(self._predicted_seconds, result.step_seconds)
            self.stats.goodput.stall_steps = self.policy.time_model.num_stalls

    def _count_proposals(self, allowed: dict[str, int], advanced: list[Request]) -> None:
        """The goodput policy learns how many drafts each request allowed drafts this
        step proposed (`ProposalRates`): those still running hold them as their
        `spec_token_ids`."""
        assert self.policy is not None
        counted = [(allowed[r.request_id], len(r.spec_token_ids)) for r in advanced
                   if allowed.get(r.request_id)]
        if self.tree is not None:  # learnt by depth
            counted = [(self.tree.depth(k), self.tree.depth(got)) for k, got in counted]
        self.policy.observe_proposals([k for k, _ in counted], [got for _, got in counted])

    def _predict_seconds(self, record: StepRecord, output: SchedulerOutput) -> None:
        """What the policy's time model expects of the step just planned (a metric)."""
        assert self.policy is not None
        live = record.live_rows()
        sampling = record.samples[live]
        self.stats.goodput.record_drafts(record.num_draft_tokens[live][sampling])
        k = self._depth(record.num_draft_tokens[live])  # a tree's: its chain's drafts
        drafter = sum(output.pass_rows.values()) - output.total_num_scheduled_tokens
        self._base_passes = sum(rows > 0 for name, rows in output.pass_rows.items()
                                if name != "target")
        passes: float = self._base_passes
        self._chained = self.method is not None and self.method.sequential
        if self._chained:
            drafter += int(np.maximum(k - 1, 0).sum())
            # Its one-row steps, as the policy priced them (a gated chain may stop short).
            passes += self.policy.chain_steps(int(k[sampling].max(initial=0)),
                                              int(sampling.sum()))
        # Rows that give logits: each sampling chunk's verified drafts and its last row.
        self._logit_rows = int((self._depth(record.num_spec[live][sampling]) + 1).sum())
        self._predicted_seconds = self.policy.time_model.predict_one(
            output.total_num_scheduled_tokens, self._logit_rows, drafter, passes)
        forecast = self.policy.forecast
        if self._chained and forecast is not None and output.num_draft_tokens:
            # A gated chain's next draft, priced at the rate the step is forecast to run.
            output.draft_price = self.policy.time_model.draft_price(
                output.total_num_scheduled_tokens, self._logit_rows, drafter, passes,
                int(sampling.sum()) + forecast)

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=self.kv.block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            eos_token_id=request.eos_token_id,
            num_drafter_computed=request.num_drafter_computed,
        )

    # ---- results back ----------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance requests by what the step produced; return what each one gained.

        Rejected drafts roll `num_computed_tokens` back (their KV is stale); accepted
        ones and the bonus/recovered token become outputs, up to the first stop
        condition (tokens after it are dropped, with their logprobs); the new drafts
        wait for the next step to verify them. The returned outputs are the only way
        the engine learns of new tokens: it never reads the requests.
        """
        check_runner_output(scheduler_output, runner_output)
        outputs: list[EngineCoreOutput] = []
        logprobs, drafts = runner_output.logprobs, runner_output.draft_token_ids
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        requests, max_model_len = self.requests, self.config.max_model_len
        advanced: list[Request] = []  # still running: their full blocks cached after
        finished = False
        verified_counts: list[int] = []
        accepted_counts: list[int] = []
        states: list[int] = []  # each verifying request's state before it (goodput)
        produced: list[int] = []  # ... and its output tokens then
        shadow_hits: list[int] = []  # parked requests' drafts checked (`max_shadows`)
        shadow_ids = runner_output.shadow_token_ids
        for rid, sampled in in_schedule_order(scheduler_output, runner_output):
            request = requests.get(rid)
            if request is None:
                continue  # aborted after it was scheduled
            if request.suspect:
                request.suspect = not sampled  # cleared by a whole step
            chosen_in = request.last_outcome  # the state this step's k was chosen in
            spec = spec_tokens.get(rid)
            if request.shadow_token_id is not None and sampled and not spec:
                shadow_hits.append(check_shadow(request, sampled[0]))
            if spec or len(sampled) > 1:
                verified = len(spec) if spec else 0
                accepted = count_accepted(request, sampled, verified)
                request.num_computed_tokens -= verified - accepted
                request.num_drafter_computed = min(request.num_drafter_computed,
                                                   request.num_computed_tokens)
                verified_counts.append(verified)
                accepted_counts.append(accepted)
                produced.append(request.num_output_tokens)
                states.append(request.record_verification(
                    verified if self.tree is None else self.tree.depth(verified), accepted))
            num_before = len(request.output_token_ids)
            status = append_tokens(request, sampled, max_model_len)
            if status is None:
                advanced.append(request)
                new_drafts = drafts.get(rid)
                request.spec_token_ids = list(new_drafts) if new_drafts else []
                request.shadow_token_id = shadow_ids.get(rid) if sampled else None
                request.drafted_in = chosen_in
                if sampled:  # nothing cut: the new tokens are the sampled ones
                    outputs.append(EngineCoreOutput(
                        rid, sampled, False, None,
                        logprobs[rid][:len(sampled)] if rid in logprobs else []))
                continue
            # Cached before the finish frees the blocks, so a one-token request's
            # prompt still serves later prefix hits.
            self.kv.cache_full_blocks((request,))
            self._finish(request, status)
            finished = True
            new = request.output_token_ids[num_before:]
            outputs.append(EngineCoreOutput(rid, new, True, request.finish_reason,
                                            logprobs[rid][:len(new)] if rid in logprobs else []))
        self.kv.cache_full_blocks(advanced)
        self.stats.spec.record_many(verified_counts, accepted_counts)
        self.stats.spec.num_leaf_hits += runner_output.leaf_hits
        if self.policy is not None:
            self._teach_policy(scheduler_output, runner_output, verified_counts,
                               accepted_counts, states, produced)
            self._count_proposals(scheduler_output.num_draft_tokens, advanced)
            if shadow_hits:
                self.stats.goodput.record_shadows(shadow_hits)
        if finished:  # (running requests left unscheduled this step stay as they are)
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

