"""Write ``tiny_corpus.txt``: short generated stories, one document per line.

The corpus shipped next to this script was written by it (``python make_tiny_corpus.py``);
the text is generated from the word lists below, so it is free of any copyright (dedicated
to the public domain, CC0). It is small (about 200 KB), plain ASCII English with a regular
grammar and a few hundred words: enough for a byte-level GPT to learn spelling, words and
phrase structure in a few hundred CPU steps, which the examples and tests rely on.

Usage::

    python examples/data/make_tiny_corpus.py [--output PATH] [--documents N] [--seed S]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

NAMES = [
    "Ada",
    "Bram",
    "Cleo",
    "Dara",
    "Elio",
    "Fern",
    "Gus",
    "Hana",
    "Ivo",
    "June",
    "Kai",
    "Lena",
    "Milo",
    "Nora",
    "Otto",
    "Pia",
    "Quin",
    "Rosa",
    "Sami",
    "Tess",
    "Uma",
    "Vik",
    "Wren",
    "Yara",
    "Zeno",
]
ANIMALS = [
    "fox",
    "owl",
    "hare",
    "badger",
    "heron",
    "otter",
    "crow",
    "deer",
    "mole",
    "wren",
    "goat",
    "horse",
    "cat",
    "dog",
    "mouse",
    "toad",
    "swan",
    "bee",
    "beetle",
    "lamb",
]
PLACES = [
    "the old mill",
    "the river bank",
    "the market square",
    "the quiet forest",
    "the hill above the town",
    "the harbour",
    "the small bakery",
    "the library",
    "the orchard",
    "the stone bridge",
    "the meadow",
    "the lighthouse",
    "the farm",
    "the railway station",
    "the garden behind the school",
    "the edge of the lake",
]
OBJECTS = [
    "a red kite",
    "a wooden box",
    "a silver key",
    "a loaf of bread",
    "a lantern",
    "a map of the valley",
    "a basket of apples",
    "a small drum",
    "a blue scarf",
    "a letter",
    "a clock",
    "a compass",
    "a jar of honey",
    "a rope",
    "a paper boat",
    "a pair of boots",
    "a bell",
    "a book of songs",
    "a bag of seeds",
    "a violin",
]
WEATHER = [
    "the sun was warm",
    "a cold wind blew from the north",
    "rain fell softly",
    "the sky was grey and still",
    "snow covered the roofs",
    "fog hung over the water",
    "the air smelled of cut grass",
    "thunder rolled far away",
    "the stars were bright",
]
TIMES = [
    "Early one morning",
    "At noon",
    "Late in the evening",
    "One autumn day",
    "On the first day of spring",
    "In the middle of the night",
    "After the harvest",
    "Before the market opened",
    "On a long summer afternoon",
    "When the bells rang",
]
FEELINGS = ["happy", "tired", "curious", "worried", "proud", "calm", "hungry", "brave"]
VERBS_PAST = [
    "found",
    "carried",
    "lost",
    "mended",
    "painted",
    "hid",
    "shared",
    "opened",
    "counted",
    "followed",
    "watched",
    "cleaned",
    "sold",
    "bought",
    "built",
    "wrapped",
]
PLURALS = {"fox": "foxes", "deer": "deer", "mouse": "mice", "goose": "geese", "lamb": "lambs"}
SURFACES = ["a notebook", "the sand", "chalk on a slate", "the margin of a map", "the snow"]
CONNECT = ["Then", "After that", "Soon", "Later", "At last", "Meanwhile", "Suddenly"]
ENDINGS = [
    "and everyone went home for supper.",
    "and the day ended with a song.",
    "and from then on they met there every week.",
    "and nobody ever forgot it.",
    "and the town was quiet again.",
    "and they laughed until the lamps were lit.",
]


def _character(rng: random.Random) -> str:
    if rng.random() < 0.6:
        return rng.choice(NAMES)
    return f"the {rng.choice(FEELINGS)} {rng.choice(ANIMALS)}"


def _sentence(rng: random.Random, hero: str, friend: str) -> str:
    kind = rng.randrange(7)
    if kind == 0:
        return f"{rng.choice(CONNECT)}, {hero} {rng.choice(VERBS_PAST)} {rng.choice(OBJECTS)} near {rng.choice(PLACES)}."
    if kind == 1:
        return f"{hero.capitalize()} felt {rng.choice(FEELINGS)} because {rng.choice(WEATHER)}."
    if kind == 2:
        return f'"Where are you going?" asked {friend}. "To {rng.choice(PLACES)}," said {hero}.'
    if kind == 3:
        count = rng.randint(2, 9)
        animal = rng.choice(ANIMALS)
        plural = PLURALS.get(animal, animal + "s")
        return f"{hero.capitalize()} counted {count} {plural} and wrote the number in {rng.choice(SURFACES)}."
    if kind == 4:
        return f"{rng.choice(CONNECT)}, {friend} {rng.choice(VERBS_PAST)} {rng.choice(OBJECTS)} for {hero}."
    if kind == 5:
        return f"The two of them walked to {rng.choice(PLACES)}, where {rng.choice(WEATHER)}."
    return f"{friend.capitalize()} said that {rng.choice(WEATHER)} and that {hero} should take {rng.choice(OBJECTS)}."


def story(rng: random.Random) -> str:
    """One generated story (a single line of text)."""
    hero, friend = _character(rng), _character(rng)
    while friend == hero:
        friend = _character(rng)
    parts = [f"{rng.choice(TIMES)}, {rng.choice(WEATHER)} and {hero} went to {rng.choice(PLACES)}."]
    parts += [_sentence(rng, hero, friend) for _ in range(rng.randint(3, 6))]
    parts.append(
        f"In the end {hero} and {friend} {rng.choice(VERBS_PAST)} {rng.choice(OBJECTS)}, {rng.choice(ENDINGS)}"
    )
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("tiny_corpus.txt"))
    parser.add_argument("--documents", type=int, default=400)
    parser.add_argument("--seed", type=int, default=20261122)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lines = [story(rng) for _ in range(args.documents)]
    args.output.write_text("\n".join(lines) + "\n", encoding="ascii")
    print(f"wrote {len(lines)} stories, {args.output.stat().st_size} bytes to {args.output}")


if __name__ == "__main__":
    main()
