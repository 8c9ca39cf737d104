"""torchrun worker: megatron-core's logits for fixed tokens from a checkpoint's weights.

``--out FILE --step-dir DIR --tokens JSON overrides...``: builds the run's model at the layout
the overrides give (not the saving one), loads the step's model tensors and writes the logits
of a causal forward over the tokens (vocab-parallel shards gathered) as a torch file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    step_dir = sys.argv.pop(sys.argv.index("--step-dir") + 1)
    tokens = json.loads(sys.argv.pop(sys.argv.index("--tokens") + 1))
    sys.argv.remove("--step-dir")
    sys.argv.remove("--tokens")
    from tests.workers.trainer_worker import build_trainer

    args, trainer = build_trainer()
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from resiliency.checkpoint.state_dict import chunks_by_key, model_state_dict

    chunks = trainer.parts.chunks
    loaded = dist_checkpointing.load(model_state_dict(chunks), str(Path(step_dir) / "model"))
    for key, chunk in chunks_by_key(chunks).items():
        chunk.load_state_dict(loaded[key], strict=True)
        chunk.eval()
    ids = torch.tensor(tokens)
    seq = ids.shape[1]
    positions = torch.arange(seq).unsqueeze(0).expand_as(ids)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        logits = chunks[0](ids, positions, causal)  # [batch, seq, vocab / tp]
        logits = gather_from_tensor_model_parallel_region(logits)
    if dist.get_rank() == 0:
        torch.save(logits.contiguous(), args.out)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
