"""Tinker's "Complete Example: Manual Training Loop", on the official `tinker` SDK, against
queue_tinker's gateway.

The training code is Tinker's. The changes: the base model (the built-in tiny model), a
dataclass + argparse config instead of chz, the training data shipped next to this file, the
loss read as `metrics["loss:sum"]` (the SDK's ForwardBackwardOutput has no `.loss`, although
its docstrings print one), and a few lines at the end that resume from the last state and
sample from the trained weights.

Start the service and its gateway (`queue-tinker up`, see README.md), make a key
(`queue-tinker keys create --tenant me`), then:
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python this_file.py
"""

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tinker
from tinker import types


@dataclass
class Config:
    model_name: str = "queue-tinker/tiny-llama"
    data_file: str = str(Path(__file__).parent / "data" / "train.jsonl")
    log_path: str = "/tmp/training"
    num_steps: int = 1000
    batch_size: int = 8
    learning_rate: float = 1e-4
    lora_rank: int = 32
    save_every: int = 100


def load_data(file_path):
    """Load training data from JSONL file"""
    import json

    data = []
    with open(file_path) as f:
        for line in f:
            data.append(json.loads(line))
    return data


def prepare_batch(data_items, tokenizer):
    """Convert data items to Datum objects"""
    batch = []
    for item in data_items:
        prompt_tokens = tokenizer.encode(item["prompt"])
        completion_tokens = tokenizer.encode(item["completion"])

        all_tokens = prompt_tokens + completion_tokens
        weights = [0.0] * len(prompt_tokens) + [1.0] * len(completion_tokens)

        datum = types.Datum(
            model_input=types.ModelInput.from_ints(all_tokens),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(
                    np.array(all_tokens[1:], dtype=np.int64)
                ),
                "weights": types.TensorData.from_numpy(np.array(weights[1:], dtype=np.float32)),
            },
        )
        batch.append(datum)
    return batch


def train(config: Config, service_client: tinker.ServiceClient):
    # Setup clients
    training_client = service_client.create_lora_training_client(
        base_model=config.model_name,
        rank=config.lora_rank,
    )
    tokenizer = training_client.get_tokenizer()

    # Load data
    data = load_data(config.data_file)

    # Optimizer parameters
    adam_params = types.AdamParams(
        learning_rate=config.learning_rate,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
    )

    # Training loop
    for step in range(config.num_steps):
        # Get batch
        start_idx = (step * config.batch_size) % len(data)
        end_idx = start_idx + config.batch_size
        batch_data = data[start_idx:end_idx]

        # Prepare batch
        batch = prepare_batch(batch_data, tokenizer)

        # Training step
        fwdbwd_future = training_client.forward_backward(
            data=batch,
            loss_fn="cross_entropy",
        )
        optim_future = training_client.optim_step(adam_params)

        # Get results
        fwdbwd_result = fwdbwd_future.result()
        optim_result = optim_future.result()  # noqa: F841 (kept as in Tinker's example)

        # Log
        print(f"Step {step}, Loss: {fwdbwd_result.metrics['loss:sum']}")

        # Save checkpoint
        if (step + 1) % config.save_every == 0:
            training_client.save_state(name=f"checkpoint-{step + 1}")

    # Resume from a saved state, optimizer included (not in Tinker's example)
    state = training_client.save_state(name="final-state").result()
    training_client.load_state_with_optimizer(state.path).result()
    print(f"Resumed from: {state.path}")

    # Final checkpoint and sampling client
    sampling_client = training_client.save_weights_and_get_sampling_client(name="final-model")

    # Sample from the trained weights (not in Tinker's example)
    prompt = types.ModelInput.from_ints(tokenizer.encode(data[0]["prompt"]))
    params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"])
    sample = sampling_client.sample(prompt, 1, params).result()
    print(f"Sample: {data[0]['prompt']!r} -> {tokenizer.decode(sample.sequences[0].tokens)!r}")
    print("Training complete!")

    return sampling_client


def main():
    # One --flag per Config field, with its default (chz.nested_entrypoint in Tinker's version).
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for option in dataclasses.fields(Config):
        parser.add_argument(
            "--" + option.name.replace("_", "-"), type=type(option.default), default=option.default
        )
    config = Config(**vars(parser.parse_args()))
    # Not in Tinker's example: the session is finished and its threads stopped before the
    # interpreter exits (one left running could abort the process at shutdown).
    with tinker.ServiceClient() as service_client:
        train(config, service_client)


if __name__ == "__main__":
    main()
