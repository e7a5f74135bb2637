"""Deterministic English text for prompts and fillers: the gate runner's synthetic tokens, gate needle's filler,
gate vram's and bench load's prompts. Shared here so that no command imports another's runner for it."""

from __future__ import annotations

import random

# Public-domain prose (Austen 1813, Melville 1851, Dickens 1859, Carroll 1865, Twain 1876, Doyle 1892,
# Shelley 1818, Stevenson 1883, Wells 1898): varied enough that the model's predictions are not trivial.
_SENTENCES = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "Call me Ishmael.",
    "Some years ago, never mind how long precisely, having little or no money in my purse, I thought I would sail about a little and see the watery part of the world.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.",
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do.",
    "Once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations in it.",
    "Tom appeared on the sidewalk with a bucket of whitewash and a long-handled brush.",
    "He surveyed the fence, and all gladness left him and a deep melancholy settled down upon his spirit.",
    "To Sherlock Holmes she is always the woman; I have seldom heard him mention her under any other name.",
    "You will rejoice to hear that no disaster has accompanied the commencement of an enterprise which you have regarded with such evil forebodings.",
    "Squire Trelawney, Dr. Livesey, and the rest of these gentlemen having asked me to write down the whole particulars about Treasure Island, I take up my pen.",
    "No one would have believed in the last years of the nineteenth century that this world was being watched keenly and closely by intelligences greater than man's.",
    "The family of Dashwood had long been settled in Sussex, and their estate was large.",
    "There was no possibility of taking a walk that day; the cold winter wind had brought with it clouds so sombre, and a rain so penetrating.",
    "The sea was calm that morning, and the little ship rode easily at anchor a mile or two from the shore.",
    "At the inn the landlord counted the coins twice before he would hand over the key to the upper room.",
    "The clock in the hall struck the hour, and somewhere below a door closed softly.",
    "By the time the coach reached the crossroads the lamps had been lit and the road was nearly empty.",
]
_TEMPLATES = [
    "In the year {y}, the {o} ship left the harbour with {n} men aboard.",
    "Chapter {r}. {s}",
    "The ledger showed {n} barrels of flour, {m} of salt, and a debt of {p} pounds.",
    "On page {n} of the old almanac someone had written the number {m} in faded ink.",
    "{s} The distance, we learned later, was {n} miles.",
]
_ROMAN = ["I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX", "X", "XI", "XII"]


def synthetic_text(n_chars: int, seed: int = 0) -> str:
    """Deterministic natural-ish text of at least n_chars characters."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        if rng.random() < 0.35:
            t = rng.choice(_TEMPLATES)
            n = rng.randint(2, 999)
            s = t.format(y=rng.randint(1650, 1899), o=_ordinal(rng.randint(1, 40)), n=n, m=rng.randint(2, 999),
                         p=rng.randint(2, 9999), r=rng.choice(_ROMAN), s=rng.choice(_SENTENCES))
        else:
            s = rng.choice(_SENTENCES)
        parts.append(s)
        if rng.random() < 0.2:
            parts.append("\n\n")
        size += len(s) + 1
    return " ".join(parts).replace(" \n\n ", "\n\n")


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def filler_prose(n_chars: int, seed: int = 0) -> str:
    """Deterministic public-domain prose WITHOUT numbers (runner's sentences, not its numbered templates):
    digits in the filler act as distractors that a small model confuses with the secret number (measured on
    the demo model: 7 of 8 placements retrieved with numbered filler, 8 of 8 without)."""
    rng = random.Random(f"rollingkv-needle-filler/{seed}")
    parts: list[str] = []
    size = 0
    while size < n_chars:
        s = rng.choice(_SENTENCES)
        parts.append(s)
        size += len(s) + 1
        if rng.random() < 0.2:
            parts.append("\n\n")
    return " ".join(parts).replace(" \n\n ", "\n\n")
