"""Stream one request while 50 others run and one is cancelled, on the embedded SmolLM2-135M-Instruct.

    python examples/stream_and_cancel.py
"""

from __future__ import annotations

from transformers import GenerationConfig

from contbatch import ContinuousBatchingConfig, continuous_batching_context_manager
from contbatch.data.embedded import load_model_and_tokenizer
from contbatch.data.prompts import chat_inputs, load_prompts


def main() -> None:
    model, tokenizer = load_model_and_tokenizer()
    questions = load_prompts(limit=52)
    inputs = chat_inputs(tokenizer, questions)
    config = GenerationConfig(do_sample=False, max_new_tokens=96, eos_token_id=tokenizer.eos_token_id)
    with continuous_batching_context_manager(model, config, ContinuousBatchingConfig(block_size=64)) as manager:
        for index, prompt in enumerate(inputs[2:]):
            manager.add_request(prompt, request_id=f"background_{index}")
        manager.add_request(inputs[1], request_id="to_cancel", max_new_tokens=400)
        manager.add_request(inputs[0], request_id="streamed", streaming=True)

        print(f"Q: {questions[0]}\nA (streamed): ", end="", flush=True)
        for step, chunk in enumerate(manager.request_id_iter("streamed")):
            print(tokenizer.decode(chunk.new_tokens, skip_special_tokens=True), end="", flush=True)
            if step == 10:
                manager.cancel_request("to_cancel")
        print()

        cancelled = manager.get_result("to_cancel", timeout=60)
        print(f"\n{cancelled.request_id}: status={cancelled.status.name} finish_reason={cancelled.finish_reason} "
              f"after {len(cancelled.generated_tokens)} tokens: "
              f"{tokenizer.decode(cancelled.generated_tokens, skip_special_tokens=True)!r}")
        finished = [manager.get_result(f"background_{index}", timeout=120) for index in range(50)]
        print(f"\n{sum(o.status.name == 'FINISHED' for o in finished)} of 50 background requests finished.")


if __name__ == "__main__":
    main()
