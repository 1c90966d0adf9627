"""A synthetic image-caption dataset whose captions depend on the images.

Every sample belongs to one of ``num_classes`` classes. Its image is the class's fixed
random template plus noise; its caption is ``<bos> a photo of <name_1> <name_2> <eos>``
where ``<name_1> <name_2>`` are the class's two name tokens. The template words are learnt
from text alone; the name tokens can only be predicted from the image, so a model whose
loss falls below the text-only floor is using its vision encoder (see
:meth:`SyntheticImageCaptionDataset.text_only_loss_floor`).

The token sequence is ``[<image>] * image_tokens + caption``, padded to ``seq_length + 1``;
``input_ids`` / ``labels`` are that sequence shifted by one, and ``loss_mask`` marks the
caption tokens after ``<bos>``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["SyntheticImageCaptionDataset"]

PAD, BOS, EOS, IMAGE = 0, 1, 2, 3
_TEMPLATE = (4, 5, 6)  # "a photo of"
_FIRST_NAME_TOKEN = 7


class SyntheticImageCaptionDataset:
    """Image-caption pairs for smoke tests and examples (deterministic per index).

    Args:
        num_samples: Number of samples.
        image_tokens: Embedding rows the vision encoder emits per image (its patches).
        seq_length: Length of ``input_ids`` (at least ``image_tokens + 6``).
        num_classes: Number of image classes (each has two name tokens).
        image_size: Side of the square images.
        channels: Image channels.
        noise: Standard deviation of the per-sample noise added to the class template.
        seed: Seed of the templates and of every sample.
        modality: Key of the vision module in ``modality_inputs``.
        encoder: Key of the encoder inside the vision module's inputs.

    Raises:
        ValueError: A size is too small for the layout of the sequence.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        image_tokens: int,
        seq_length: int,
        num_classes: int = 8,
        image_size: int = 16,
        channels: int = 3,
        noise: float = 0.5,
        seed: int = 0,
        modality: str = "vision",
        encoder: str = "patch_encoder",
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        caption = 1 + len(_TEMPLATE) + 2 + 1
        if seq_length < image_tokens + caption - 1:
            raise ValueError(
                f"seq_length={seq_length} is too short for {image_tokens} image tokens and a "
                f"{caption}-token caption; use at least {image_tokens + caption - 1}"
            )
        self.num_samples = num_samples
        self.image_tokens = image_tokens
        self.seq_length = seq_length
        self.num_classes = num_classes
        self.image_size = image_size
        self.channels = channels
        self.noise = noise
        self.seed = seed
        self.modality = modality
        self.encoder = encoder
        gen = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(num_classes, channels, image_size, image_size, generator=gen)

    @property
    def vocab_size(self) -> int:
        """Smallest vocabulary that holds every token the dataset emits."""
        return _FIRST_NAME_TOKEN + 2 * self.num_classes

    @property
    def image_token_id(self) -> int:
        """Token id marking the positions of the image embeddings."""
        return IMAGE

    def class_of(self, index: int) -> int:
        """Class of sample ``index``."""
        return self._draw(index)[0]

    def _draw(self, index: int) -> tuple[int, torch.Generator]:
        """The class of sample ``index`` and the generator its noise is drawn from."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        return int(torch.randint(0, self.num_classes, (), generator=gen)), gen

    def name_tokens(self, label: int) -> tuple[int, int]:
        """The two caption tokens naming class ``label``."""
        return _FIRST_NAME_TOKEN + 2 * label, _FIRST_NAME_TOKEN + 2 * label + 1

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        label, gen = self._draw(index)
        noise = torch.randn(self.channels, self.image_size, self.image_size, generator=gen)
        image = self.templates[label] + self.noise * noise
        caption = [BOS, *_TEMPLATE, *self.name_tokens(label), EOS]
        tokens = [IMAGE] * self.image_tokens + caption
        tokens += [PAD] * (self.seq_length + 1 - len(tokens))
        sequence = torch.tensor(tokens, dtype=torch.long)
        labels = sequence[1:].clone()
        caption_start = self.image_tokens  # position of <bos> in the sequence
        loss_mask = torch.zeros(self.seq_length, dtype=torch.float32)
        # labels[i] = sequence[i + 1]: predict every caption token after <bos>.
        loss_mask[caption_start : caption_start + len(caption) - 1] = 1.0
        return {
            "input_ids": sequence[:-1].clone(),
            "labels": labels,
            "loss_mask": loss_mask,
            "modality_inputs": {self.modality: {self.encoder: {"images": image}}},
            "class_label": torch.tensor(label),
        }

    def text_only_loss_floor(self) -> float:
        """Mean per-token loss of the best model that ignores the images.

        Template tokens and ``<eos>`` are certain from text; the first name token is uniform
        over the classes (``log num_classes``) and the second follows from the first. The
        loss mask covers ``len(template) + 3`` tokens per sample.
        """
        return math.log(self.num_classes) / (len(_TEMPLATE) + 3)
