"""The vision pathway: DeepSeek-ViT, pixel-unshuffle projector, image spans, SigLIP pre-training."""
