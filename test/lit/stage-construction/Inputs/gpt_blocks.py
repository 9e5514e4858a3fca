"""Writes the training step of a small GPT with N identical transformer blocks (hidden 64,
4 heads, 16 tokens, vocabulary 128, batch 8) as StableHLO text, lowered with abstract shapes:

    python gpt_blocks.py 4 -o gpt4.mlir

Parameters are flattened as JAX does: embed (positions, tokens), final_ln (bias, scale), then
12 arrays per block, block 0 first; then Adam's state and the batch.
"""

import argparse

from hlopar.models.gpt import GPTConfig, train_step

parser = argparse.ArgumentParser()
parser.add_argument("blocks", type=int)
parser.add_argument("-o", "--output", required=True)
args = parser.parse_args()
config = GPTConfig(hidden_size=64, num_layers=args.blocks, num_heads=4, seq_len=16, vocab_size=128, batch_size=8)
with open(args.output, "w") as out:
    out.write(train_step(config).lower())
