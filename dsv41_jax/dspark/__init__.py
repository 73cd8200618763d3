"""DSpark: the speculative drafter trained on a frozen backbone (docs/design.md §16).

  config.py     DrafterConfig: 3 blocks, 128-token window, 5 draft positions, head sizes
  attention.py  the drafter's attention math: context rows and draft queries, in training (all
                anchors of a row at once) and in decoding (per-layer rings of context keys)
  model.py      the Drafter module: fused hidden state + embedding, blocks, base logits through the
                backbone's head, the Markov head, the confidence head; drafting k tokens
  loss.py       draft cross-entropy against the backbone, confidence against realised acceptance
"""
