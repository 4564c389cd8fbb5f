"""Write recipes/data/smollm2_chat.jsonl and smollm2_chat_val.jsonl: short chats in which the assistant is
Captain Byte, a pirate, for recipes/smollm2-chat.yaml (SmolLM2-135M-Instruct).

    python recipes/data/make_smollm2_chat_data.py      # rewrites both files next to this script
    python recipes/data/make_smollm2_chat_data.py --rows 300 --val-rows 40 --seed 0 --out-dir /tmp/x

Every answer has the same shape, which a LoRA adapter visibly learns within a few dozen steps:
  "Arr! <a short, correct answer in a pirate's words>. Fair winds, matey!"
over questions about capitals, sums, colours, animals, opposites, days, numbers, plurals, legs and the
captain himself. Each row holds the conversation as `messages` (OpenAI-style, ready for a chat data format)
and the same conversation as `prompt` / `completion`: the prompt is the user turn rendered with SmolLM2's
ChatML chat template (which adds its default system turn) up to the assistant's header, the completion is
the assistant's words (the trainer appends the tokenizer's eos, `<|im_end|>`, which ends the turn).
Validation rows ask questions the training rows never ask. Standard library only; the same arguments always
write the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# SmolLM2-135M-Instruct's chat template, for a conversation without a system turn.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
OPEN, CLOSE = "Arr! ", " Fair winds, matey!"

CAPITALS = {
    "France": "Paris",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Germany": "Berlin",
    "Japan": "Tokyo",
    "Egypt": "Cairo",
    "Canada": "Ottawa",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Greece": "Athens",
    "Portugal": "Lisbon",
    "Ireland": "Dublin",
    "Poland": "Warsaw",
    "Austria": "Vienna",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Chile": "Santiago",
    "Cuba": "Havana",
}
COLOURS = {
    "the sky on a clear day": "blue",
    "grass": "green",
    "fresh snow": "white",
    "a ripe banana": "yellow",
    "coal": "black",
    "a ripe tomato": "red",
    "an orange": "orange",
    "a lemon": "yellow",
    "the sea on a sunny day": "blue",
    "a lump of charcoal": "black",
    "a fresh leaf": "green",
    "milk": "white",
}
SOUNDS = {
    "a cow": "moo",
    "a dog": "woof",
    "a cat": "meow",
    "a duck": "quack",
    "a sheep": "baa",
    "a lion": "roar",
    "an owl": "hoot",
    "a pig": "oink",
    "a snake": "hiss",
    "a horse": "neigh",
}
OPPOSITES = {
    "hot": "cold",
    "up": "down",
    "big": "small",
    "fast": "slow",
    "day": "night",
    "wet": "dry",
    "open": "closed",
    "happy": "sad",
    "full": "empty",
    "light": "dark",
    "early": "late",
    "loud": "quiet",
}
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
PLURALS = {
    "mouse": "mice",
    "child": "children",
    "foot": "feet",
    "tooth": "teeth",
    "goose": "geese",
    "man": "men",
    "woman": "women",
    "person": "people",
    "sheep": "sheep",
    "fish": "fish",
    "box": "boxes",
    "knife": "knives",
    "leaf": "leaves",
    "wolf": "wolves",
    "city": "cities",
}
LEGS = {"a spider": 8, "a dog": 4, "a bird": 2, "an ant": 6, "a horse": 4, "a chicken": 2, "a beetle": 6}
ABOUT = [
    ("Who are you?", "I be Captain Byte, a pirate who sails the seas of data"),
    ("What is your name?", "They call me Captain Byte, terror of the seven seas"),
    ("Hello!", "Ahoy there, friend, Captain Byte be at yer service"),
    ("Good morning!", "A fine mornin' to ye, the sun be bright on the deck"),
    ("What do you like to eat?", "I be fond of salted fish and hard biscuits"),
    ("Where do you live?", "I live aboard me ship, the Flying Bit"),
    ("Do you have a pet?", "Aye, a green parrot named Pixel sits on me shoulder"),
    ("What is your favourite colour?", "Me favourite colour be the deep blue of the sea"),
    ("Can you help me?", "Aye, ask away and I'll do me best for ye"),
    ("Thank you!", "Ye be most welcome, friend"),
    ("How are you today?", "I be shipshape and ready to sail"),
    ("What is your ship called?", "Me ship be the Flying Bit, fastest on the seas"),
]

CAPITAL_Q = ("What is the capital of {}?", "Which city is the capital of {}?", "Tell me the capital of {}.")
SUM_Q = ("What is {} plus {}?", "How much is {} + {}?", "Add {} and {}.")
COLOUR_Q = ("What color is {}?", "What colour is {}?")
SOUND_Q = ("What sound does {} make?", "What noise does {} make?")
OPPOSITE_Q = ("What is the opposite of {}?", "Give me the opposite of {}.")
DAY_Q = ("What day comes after {}?", "Which day follows {}?")
NEXT_Q = ("What number comes after {}?", "Which number follows {}?")
PLURAL_Q = ("What is the plural of {}?", "What do you call more than one {}?")
LEGS_Q = ("How many legs does {} have?", "Count the legs of {}.")


def render_prompt(user: str) -> str:
    """The user turn as SmolLM2's ChatML template renders it with `add_generation_prompt=True`."""
    return (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def questions() -> list[tuple[str, str]]:
    """Every (question, answer without the opening and closing phrase) the generator can ask."""
    out = []
    for country, city in CAPITALS.items():
        out += [(q.format(country), f"The capital of {country} be {city}, a fine port") for q in CAPITAL_Q]
    for a in range(2, 8):
        for b in range(2, 8):
            out += [(q.format(a, b), f"{a} plus {b} be {a + b}, as sure as the tide") for q in SUM_Q]
    for thing, colour in COLOURS.items():
        out += [(q.format(thing), f"{thing[0].upper() + thing[1:]} be {colour}") for q in COLOUR_Q]
    for animal, sound in SOUNDS.items():
        out += [(q.format(animal), f"{animal[0].upper() + animal[1:]} says {sound}") for q in SOUND_Q]
    for word, opposite in OPPOSITES.items():
        out += [(q.format(word), f"The opposite of {word} be {opposite}") for q in OPPOSITE_Q]
    for i, day in enumerate(DAYS):
        after = DAYS[(i + 1) % len(DAYS)]
        out += [(q.format(day), f"After {day} comes {after}") for q in DAY_Q]
    for animal, legs in LEGS.items():
        out += [(q.format(animal), f"{animal[0].upper() + animal[1:]} has {legs} legs") for q in LEGS_Q]
    for n in range(1, 21):
        out += [(q.format(n), f"After {n} comes {n + 1}, one more doubloon") for q in NEXT_Q]
    for word, plural in PLURALS.items():
        out += [(q.format(word), f"More than one {word} be {plural}") for q in PLURAL_Q]
    out += ABOUT
    return out


def make_row(question: str, answer: str) -> dict:
    reply = f"{OPEN}{answer}.{CLOSE}"
    return {
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}],
        "prompt": render_prompt(question),
        "completion": reply,
    }


def make_rows(n: int, n_val: int, seed: int) -> tuple[list[dict], list[dict]]:
    """`n` training rows and `n_val` validation rows, drawn without overlap from `questions()`."""
    pool = questions()
    if n + n_val > len(pool):
        raise SystemExit(f"only {len(pool)} distinct questions: ask for at most that many rows in all")
    random.Random(seed).shuffle(pool)
    return [make_row(*qa) for qa in pool[:n]], [make_row(*qa) for qa in pool[n : n + n_val]]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--val-rows", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train, val = make_rows(args.rows, args.val_rows, args.seed)
    write_jsonl(args.out_dir / "smollm2_chat.jsonl", train)
    write_jsonl(args.out_dir / "smollm2_chat_val.jsonl", val)


if __name__ == "__main__":
    main()
