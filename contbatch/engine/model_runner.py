"""`ModelRunner`: packs a scheduled batch into tensors and runs the stock model's forward once."""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Collection
from contextlib import nullcontext

import torch
from transformers import CompileConfig, PreTrainedModel

from contbatch.engine.attention import (
    METADATA_KWARG,
    AttentionGroup,
    PagedAttentionMetadata,
    attends_ragged,
    paged_forward,
    register_paged_attention,
    remember_own_attention,
)
from contbatch.engine.attention_groups import (
    MAX_PADDING,
    attention_group,
    group_to_device,
    padding_bounded_sets,
    ragged_group,
)
from contbatch.engine.batch import SamplingTarget, ScheduledRequest, SchedulerOutput
from contbatch.engine.compile import COMPILED_MARKER, shared_compiled_forward, step_metadata
from contbatch.engine.compile_padding import pad_for_compile
from contbatch.engine.cuda_graphs import CudaGraphBackend, Forward, GraphBackend, GraphSettings, StepGraphs
from contbatch.engine.device_values import device_tensor
from contbatch.engine.fused_modules import fused_forward
from contbatch.engine.handoff import DrawnStep, PreparedBatch, int_tensor
from contbatch.engine.head_buffer import reusing_logits
from contbatch.engine.head_screen import plain_greedy, screen_allowed, screened_forward
from contbatch.engine.kv_cache import PagedKVCache
from contbatch.engine.logits_processors import apply_processors
from contbatch.engine.model_support import (
    check_attended,
    check_config,
    check_logits_kept,
    check_numbering,
    check_positions,
)
from contbatch.engine.outputs import ModelRunnerOutput, PromptLogprob
from contbatch.engine.packed_weights import packed_forward, weights_changed
from contbatch.engine.prompt_logprobs import prompt_logprobs, prompt_rows
from contbatch.engine.sampler import Sampler, SamplerOutput
from contbatch.engine.structured import apply_bitmask, fill_bitmasks

_SCREENED = "_contbatch_screened_tokens"


class ModelRunner:
    """Runs `model` with contbatch's paged attention, then samples.

    While the runner is attached the model's attention implementation is contbatch's; `close()` restores the one
    it had. Every step is one forward over one packed, ragged batch (`[1, num_tokens]`, no padding between
    requests), and logits are computed only at the positions that sample (`execute`); sampling is a separate
    stage (`sample`), so a logits mask can come between the two. The engine's steps (`head_screen.screen_allowed`)
    let a plain greedy step skip its logits: the head screen finds the argmax without them.

    Prompt logprobs: `execute` also keeps the logits rows of the chunks that ask for them (a
    `PromptLogprobsTask`) and turns them into entries at once; the next `sample` hands those entries on in its
    `ModelRunnerOutput.prompt_logprobs`. Requests that do not ask cost nothing: no extra rows are computed.

    `compile_paths` ("decode" / "varlen" -> `CompileConfig`) runs those steps through `torch.compile`d forwards
    (`CompiledForward`, shared by the engines of one model); the others run eagerly.

    `graphs` (settings, or None) replays steps from captured graphs (`StepGraphs`), through `graph_backend` (CUDA
    graphs by default): decode steps whose every request samples, and varlen steps where a kernel
    attends them in one ragged group (`ragged`).
    """

    def __init__(self, model: PreTrainedModel, cache: PagedKVCache,
                 compile_paths: dict[str, CompileConfig] | None = None, graphs: GraphSettings | None = None,
                 graph_backend: GraphBackend | None = None, renumbered: Collection[int] = (),
                 step_rows: int = 0) -> None:
        """`renumbered`: the layers where the engine's probing forward saw the model tell equal tokens at one
        position apart (`kv_probe.LayerProbe`); the first forward refuses such a model (`check_numbering`).
        `step_rows`: the rows of a full step (the scheduler's token budget; `packed_forward`)."""
        self.model = model
        self.step_rows = step_rows
        self.renumbered = frozenset(renumbered)
        self.cache = cache
        self.compiled = shared_compiled_forward(model, compile_paths) if compile_paths else None
        self.graphs = None if graphs is None else StepGraphs(cache, graphs, graph_backend or CudaGraphBackend())
        self._weight_addresses = _parameter_addresses(model)
        # sliding groups leave DEAD_BLOCK entries in block tables
        self.windows = tuple(group.sliding_window for group in cache.groups)
        self.has_dead_blocks = any(window is not None for window in self.windows)
        self.sampler = Sampler()
        self.device = cache.keys[0].device
        self.ragged = attends_ragged(model, cache)
        self._previous_attention: str | None = None
        self._prompt_logprobs: dict[str, list[PromptLogprob]] = {}
        self.head_is_final: bool | None = None
        self.attention_checked = False
        self.attach()

    def attach(self) -> None:
        """Switches the model to contbatch's paged attention (idempotent). Forwards other than contbatch's keep
        running the implementation the model had (see `paged_attention_forward`)."""
        if self._previous_attention is None:
            self._previous_attention = self.model.config._attn_implementation
            remember_own_attention(self.model)
            self.model.set_attn_implementation(register_paged_attention())

    def close(self) -> None:
        """Gives the model back its own attention implementation (idempotent); `attach` takes it again."""
        if self._previous_attention is not None:
            self.model.set_attn_implementation(self._previous_attention)
            self._previous_attention = None

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput, prepared: PreparedBatch | None = None) -> torch.Tensor:
        """Computes the batch's tokens into the cache; returns the logits [scheduled requests that sample,
        vocab], in batch order. Inside `head_screen.screen_allowed()`, a plain greedy step may skip its logits
        through the head screen: the result is then a placeholder carrying the tokens, which only `sample`, without
        a mask, may read. The logits rows of prompt logprobs tasks are computed in the same forward, after
        the sampling rows, and become the entries the next `sample` returns. `prepared`: the batch's inputs from
        `prepare` (made now when None), with the tokens carried into it (`PreparedBatch.carry`)."""
        self._prompt_logprobs = {}
        batch = prepared if prepared is not None else self.prepare(scheduler_output)
        input_ids = batch.device_input_ids(self.device)
        positions, logits_indices = (tensor.to(self.device, non_blocking=True) for tensor in (
            batch.positions, batch.logits_indices))
        metadata = PagedAttentionMetadata(self.cache, batch.slot_mapping.to(self.device, non_blocking=True), [
            group_to_device(group, self.device) for group in batch.groups
        ])
        self.cache.copy_blocks(scheduler_output.block_copies)
        path = "decode" if len(input_ids) == len(scheduler_output.requests) else "varlen"
        num_sampling = sum(1 for entry in scheduler_output.requests if entry.samplers)
        forward = functools.partial(self._forward, path)
        logits = self._replayed(path, input_ids, positions, logits_indices, num_sampling, metadata, forward)
        if logits is None:
            inputs = {"input_ids": input_ids.unsqueeze(0), "position_ids": positions.unsqueeze(0),
                      "logits_to_keep": logits_indices}
            if self.compiled is not None and path in self.compiled.paths:
                inputs, metadata = pad_for_compile(inputs, metadata)
            if (self.head_is_final is not False and screen_allowed() and len(logits_indices) == num_sampling > 0
                    and plain_greedy(scheduler_output.sampling_targets)):
                return self._screened(functools.partial(forward, inputs, metadata), num_sampling)
            logits = forward(inputs, metadata)[:len(logits_indices)]
        self._prompt_logprobs = prompt_logprobs(logits[num_sampling:], scheduler_output.requests)
        return logits[:num_sampling]

    def _replayed(self, path: str, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                  num_sampling: int, metadata: PagedAttentionMetadata, forward: Forward) -> torch.Tensor | None:
        """The step's logits from a captured graph (`StepGraphs`), or None when it runs eagerly: a decode step
        whose every request samples, a varlen step whose every logits row samples (its bucket seen before)."""
        if self.graphs is None or len(logits_indices) != num_sampling:
            return None
        if path == "decode":
            return self.graphs.run(input_ids, positions, metadata, forward) if num_sampling == len(input_ids) else None
        return self.graphs.run_varlen(input_ids, positions, logits_indices, metadata, forward)

    def _screened(self, forward: Callable[[], torch.Tensor], rows: int) -> torch.Tensor:
        """The logits of a plain greedy step through the head screen (`head_screen.screened_forward`): when it
        served the step they are a placeholder carrying the tokens, which `sample` takes."""
        logits, tokens, self.head_is_final = screened_forward(forward, rows, self.head_is_final)
        logits = logits[:rows]
        if tokens is not None:
            setattr(logits, _SCREENED, tokens)
        return logits

    def _forward(self, path: str, inputs: dict[str, torch.Tensor], metadata: PagedAttentionMetadata) -> torch.Tensor:
        """The model's forward over a packed batch (compiled when `path` is); returns logits [rows, vocab]. The
        weights go through their packed copies (`packed_forward`) except in a frozen graph, where inductor packs them
        itself; an eager CPU forward runs the norms and MLP gating fused (`fused_forward`), and in the engine's
        steps (`screen_allowed`) may leave large logits in the thread's reused buffer (`reusing_logits`). Until
        one forward has shown every layer attending through contbatch (`check_attended`), the positions taken
        (`check_positions`) and only the kept rows' logits returned (`check_logits_kept`), each raises
        `UnsupportedModelError` when not, or, before it runs, when the model's config asks for what the paged
        attention cannot reproduce (`check_config`: ALiBi, layers that keep a recurrent state, other attention
        than full, sliding or chunked) or the probe saw it number its tokens itself (`check_numbering`)."""
        compiled = self.compiled if self.compiled is not None and path in self.compiled.paths else None
        frozen = compiled is not None and compiled.freezes_weights
        fused = compiled is None and self.device.type == "cpu"
        if not self.attention_checked:
            check_config(self.model)
            check_numbering(self.model, self.renumbered)
        metadata.attended.clear()
        published = metadata if compiled is None else COMPILED_MARKER
        with (paged_forward(published), nullcontext() if frozen else packed_forward(self.model, self.step_rows),
              fused_forward(self.model) if fused else nullcontext(), reusing_logits(fused and screen_allowed())):
            if compiled is not None:
                with step_metadata(metadata):
                    output = compiled(path, **inputs, use_cache=False, **{METADATA_KWARG: published})
            else:
                output = self.model(**inputs, use_cache=False, **{METADATA_KWARG: published})
        if not self.attention_checked:
            check_attended(self.model, metadata.attended, self.cache.layers)
            check_positions(self.model)
            check_logits_kept(self.model, output.logits.shape[-2], len(inputs["logits_to_keep"]))
            self.attention_checked = True
        return output.logits[0]

    def weights_replaced(self) -> None:
        """Drops what holds the model's weights as they were: frozen compiled graphs (and the decode graphs
        captured from them), and captured decode graphs when a parameter has a new storage (graphs read
        parameters by address: in-place updates keep them), and the packed copies of the weights."""
        weights_changed(self.model)
        if self.compiled is not None and self.compiled.freezes_weights:
            self.compiled.reset()
            self.drop_graphs()
        addresses = _parameter_addresses(self.model)
        if addresses != self._weight_addresses:
            self.drop_graphs()
            self._weight_addresses = addresses

    def drop_graphs(self) -> None:
        """Drops the captured decode graphs and their memory; later decode steps capture again."""
        if self.graphs is not None:
            self.graphs.clear()

    def sample(self, logits: torch.Tensor, scheduler_output: SchedulerOutput,
               logits_mask: torch.Tensor | None = None, live: list[bool] | None = None) -> ModelRunnerOutput:
        """`draw`, resolved on the host."""
        return self.draw(logits, scheduler_output, logits_mask, live).resolve()

    @torch.inference_mode()
    def draw(self, logits: torch.Tensor, scheduler_output: SchedulerOutput,
             logits_mask: torch.Tensor | None = None, live: list[bool] | None = None) -> DrawnStep:
        """Chooses the token of every sampling target of the step from `logits` (as returned by `execute`), on
        the logits' device (`DrawnStep.resolve` brings them to the host). `logits_mask` ([targets, vocab] bool,
        True = allowed), when given, removes tokens before sampling (the hook for grammar bitmasks); removed
        tokens are -inf in both "raw" and "processed" logprobs (never in prompt logprobs). `live` (one flag per
        target), when given, leaves out the targets flagged False (ended while the step was in flight). The
        result carries the prompt logprobs of the latest `execute`, so it must be drawn before the next one."""
        prompt, self._prompt_logprobs = self._prompt_logprobs, {}
        targets = scheduler_output.sampling_targets
        screened: torch.Tensor | None = getattr(logits, _SCREENED, None)
        rows = None
        if live is not None and not all(live):
            targets = [target for target, keep in zip(targets, live, strict=True) if keep]
            rows = [row for row, keep in zip(scheduler_output.sampling_rows, live, strict=True) if keep]
            if logits_mask is not None:
                logits_mask = logits_mask[torch.tensor(live)]
        elif len(targets) != logits.shape[0]:  # n samples of a prompt share its logits row
            rows = scheduler_output.sampling_rows
        request_ids = [target.request_id for target in targets]
        if screened is not None:
            if logits_mask is not None:
                raise ValueError("a step served by the head screen has no logits to mask")
            tokens = screened if rows is None else screened[torch.tensor(rows, dtype=torch.long)]
            return DrawnStep(request_ids, SamplerOutput(tokens, None), prompt)
        if rows is not None:
            logits = logits[device_tensor(rows, logits.device, torch.long)]
        if logits_mask is not None:
            logits = logits.masked_fill(~logits_mask.to(logits.device, non_blocking=True), float("-inf"))
        logits = _apply_grammars(logits, targets)
        sampled = self.sampler.draw(logits, [t.params for t in targets], [t.generator for t in targets],
                                    [t.history for t in targets] if any(t.history for t in targets) else None)
        return DrawnStep(request_ids, sampled, prompt, _beam_scores(logits, targets))

    def prepare(self, scheduler_output: SchedulerOutput) -> PreparedBatch:
        """Builds, on the host, input ids, positions, the indices of the logits rows to compute (the sampling
        tokens in batch order, then the rows of the prompt logprobs tasks in batch order) and the attention
        groups with tensor ops over the whole batch: the only per-request Python work is reading its tokens and
        block tables. Reads nothing the step in flight changes, so it may run while that step's forward does."""
        block_size = self.cache.block_size
        scheduled = scheduler_output.requests
        token_ids = int_tensor(token for entry in scheduled for token in entry.token_ids)
        block_tables = _block_tables(scheduled)
        if self.has_dead_blocks:
            # Blocks left behind by a sliding window are masked but still gathered: point them at a live block.
            first_live = block_tables.gather(2, (block_tables >= 0).int().argmax(2, keepdim=True))
            block_tables = torch.where(block_tables < 0, first_live, block_tables)
        counts = int_tensor(len(entry.token_ids) for entry in scheduled)
        starts = int_tensor(entry.num_computed_tokens for entry in scheduled)
        offsets = torch.cumsum(counts, 0) - counts
        request_of_token = torch.repeat_interleave(torch.arange(len(scheduled)), counts)
        positions = torch.arange(len(token_ids)) - offsets[request_of_token] + starts[request_of_token]
        slot_mapping = block_tables[:, request_of_token, positions // block_size] * block_size + positions % block_size
        samples = int_tensor(len(entry.samplers) for entry in scheduled) > 0
        logits_indices = (offsets + counts - 1)[samples]
        scored_rows = prompt_rows(scheduled, offsets)
        if scored_rows:
            logits_indices = torch.cat([logits_indices, *scored_rows])
        if self.ragged and len(token_ids) > len(scheduled):
            groups = [ragged_group(counts, starts, positions, request_of_token, block_tables, block_size,
                                   self.windows)]
        else:
            groups = self._padded_groups(counts, starts, offsets, block_tables, len(token_ids))
        carried = [index for index, entry in enumerate(scheduled) if entry.carried]
        return PreparedBatch(token_ids, positions, logits_indices, slot_mapping, groups,
                             (offsets + counts - 1)[carried].tolist(), [scheduled[i].request_id for i in carried])

    def _padded_groups(self, counts: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor,
                       block_tables: torch.Tensor, num_tokens: int) -> list[AttentionGroup]:
        """The decoding requests in one group, the others in groups of bounded padding (one on a GPU)."""
        single = counts == 1
        member_sets = [single.nonzero().squeeze(1)] if bool(single.any()) else []
        member_sets += padding_bounded_sets((~single).nonzero().squeeze(1), counts, starts,
                                            MAX_PADDING if self.device.type == "cpu" else None)
        groups = [attention_group(members, counts, starts, offsets, block_tables, self.cache.block_size,
                                  self.windows) for members in member_sets]
        if len(groups) == 1 and groups[0].real_queries is None:
            groups[0].whole_batch = torch.equal(groups[0].query_rows, torch.arange(num_tokens))
        return groups


def _parameter_addresses(model: torch.nn.Module) -> tuple[int, ...]:
    return tuple(parameter.data_ptr() for parameter in model.parameters())


def _beam_scores(logits: torch.Tensor, targets: list[SamplingTarget]) -> dict[str, torch.Tensor]:
    """The processed log-probabilities of each beam target (as `generate`'s beam search: log_softmax of the
    float32 logits, then the logits processors), on CPU."""
    rows = [row for row, target in enumerate(targets) if target.params.num_beams > 1]
    if not rows:
        return {}
    beams = [targets[row] for row in rows]
    log_probs = torch.log_softmax(logits[device_tensor(rows, logits.device)].float(), dim=-1)
    scores = apply_processors(log_probs, [t.params for t in beams], [t.history for t in beams]).cpu()
    return {target.request_id: scores[j] for j, target in enumerate(beams)}


def _apply_grammars(logits: torch.Tensor, targets: list[SamplingTarget]) -> torch.Tensor:
    """`logits` with -inf at every token the grammar of a structured target does not allow next (a copy when
    any target has a grammar: the forward's logits are left as they are)."""
    rows = [row for row, target in enumerate(targets) if target.matcher is not None]
    if not rows:
        return logits
    matchers = [targets[row].matcher for row in rows]
    bitmask = fill_bitmasks([m for m in matchers if m is not None], logits.shape[1])
    logits = logits.clone()
    apply_bitmask(logits, bitmask, rows)
    return logits


def _block_tables(scheduled: list[ScheduledRequest]) -> torch.Tensor:
    """[groups, requests, width]: each request's block table of each group, padded with block 0 to the
    longest (every group's tables of one request have the same length)."""
    width = max(len(entry.block_tables[0]) for entry in scheduled)
    flat = array("q")
    for entry in scheduled:
        for table in entry.block_tables:
            flat.extend(table)
            flat.frombytes(bytes(flat.itemsize * (width - len(table))))
    return torch.frombuffer(flat, dtype=torch.int64).view(len(scheduled), -1, width).transpose(0, 1)
