"""Generate the GSM8K-format arithmetic word problems shipped in this folder.

Run `python env_servers/data/gsm8k/generate.py` to rewrite `train.jsonl` and `test.jsonl`.
The output is a pure function of SEED: rerunning produces byte-identical files.

Each row follows GSM8K's format: {"question": ..., "answer": "<reasoning>\\n#### <number>"},
with intermediate calculations annotated as <<expr=value>> the way GSM8K writes them.
"""

import json
import random
from collections.abc import Callable
from pathlib import Path

SEED = 20240611
TRAIN_SIZE = 250
TEST_SIZE = 60

NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Diego",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonah",
    "Keiko",
    "Liam",
    "Maya",
    "Noor",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
]
ITEMS = [
    "apples",
    "pencils",
    "stickers",
    "marbles",
    "cookies",
    "books",
    "shells",
    "cards",
    "stamps",
    "beads",
]

Problem = tuple[str, list[str], int]  # question, reasoning lines, final answer


def _calc(expr: str, value: int) -> str:
    """GSM8K's calculator annotation: `expr = <<expr=value>>value`."""
    return f"{expr} = <<{expr}={value}>>{value}"


def buy_and_change(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 12), rng.randint(2, 9)
    cost = count * price
    paid = (cost // 10 + rng.randint(1, 5)) * 10
    change = paid - cost
    question = (
        f"{name} buys {count} {item} that cost ${price} each and pays with ${paid}. "
        f"How much change, in dollars, does {name} get back?"
    )
    steps = [
        f"The {item} cost {_calc(f'{count}*{price}', cost)} dollars.",
        f"The change is {_calc(f'{paid}-{cost}', change)} dollars.",
    ]
    return question, steps, change


def share_equally(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, kept = rng.randint(2, 8), rng.randint(3, 15), rng.randint(1, 10)
    total = friends * each + kept
    question = (
        f"{name} has {total} {item}. {name} keeps {kept} and shares the rest equally "
        f"among {friends} friends. How many {item} does each friend get?"
    )
    shared = total - kept
    steps = [
        f"{name} shares {_calc(f'{total}-{kept}', shared)} {item}.",
        f"Each friend gets {_calc(f'{shared}/{friends}', each)} {item}.",
    ]
    return question, steps, each


def weekly_savings(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    per_week, weeks = rng.randint(5, 40), rng.randint(3, 12)
    saved = per_week * weeks
    spent = rng.randint(1, min(30, saved - 1))
    left = saved - spent
    question = (
        f"{name} saves ${per_week} every week for {weeks} weeks, then spends ${spent} "
        f"on a gift. How many dollars does {name} have left?"
    )
    steps = [
        f"{name} saves {_calc(f'{per_week}*{weeks}', saved)} dollars.",
        f"After the gift {name} has {_calc(f'{saved}-{spent}', left)} dollars.",
    ]
    return question, steps, left


def rectangle_area(rng: random.Random) -> Problem:
    width, length = rng.randint(3, 30), rng.randint(3, 30)
    price = rng.randint(2, 12)
    area = width * length
    cost = area * price
    question = (
        f"A garden is {width} meters wide and {length} meters long. Sod costs ${price} "
        f"per square meter. How many dollars does it cost to cover the whole garden?"
    )
    steps = [
        f"The area is {_calc(f'{width}*{length}', area)} square meters.",
        f"The sod costs {_calc(f'{area}*{price}', cost)} dollars.",
    ]
    return question, steps, cost


def speed_distance(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    speed, hours, extra = rng.randint(20, 90), rng.randint(2, 6), rng.randint(5, 60)
    first = speed * hours
    total = first + extra
    question = (
        f"{name} drives at {speed} km per hour for {hours} hours and then drives another "
        f"{extra} km. How many kilometers does {name} drive in total?"
    )
    steps = [
        f"In {hours} hours {name} drives {_calc(f'{speed}*{hours}', first)} km.",
        f"In total {name} drives {_calc(f'{first}+{extra}', total)} km.",
    ]
    return question, steps, total


def percent_discount(rng: random.Random) -> Problem:
    item = rng.choice(["jacket", "bicycle", "lamp", "backpack", "guitar", "chair"])
    price = rng.randint(1, 20) * 20  # a multiple of 20 keeps every listed percent whole
    percent = rng.choice([10, 20, 25, 30, 50])
    discount = price * percent // 100
    final = price - discount
    question = (
        f"A {item} costs ${price}. It is on sale for {percent}% off. "
        f"What is the sale price in dollars?"
    )
    steps = [
        f"The discount is {_calc(f'{price}*{percent}/100', discount)} dollars.",
        f"The sale price is {_calc(f'{price}-{discount}', final)} dollars.",
    ]
    return question, steps, final


def age_puzzle(rng: random.Random) -> Problem:
    child, parent = rng.sample(NAMES, 2)
    age, factor, years = rng.randint(3, 15), rng.randint(2, 4), rng.randint(2, 10)
    parent_age = age * factor
    future = parent_age + years
    question = (
        f"{child} is {age} years old. {parent} is {factor} times as old as {child}. "
        f"How old will {parent} be in {years} years?"
    )
    steps = [
        f"{parent} is {_calc(f'{age}*{factor}', parent_age)} years old now.",
        f"In {years} years {parent} will be {_calc(f'{parent_age}+{years}', future)}.",
    ]
    return question, steps, future


def boxes_and_leftovers(rng: random.Random) -> Problem:
    item = rng.choice(ITEMS)
    boxes, per_box, sold = rng.randint(3, 20), rng.randint(6, 24), rng.randint(5, 40)
    total = boxes * per_box
    sold = min(sold, total - 1)
    left = total - sold
    question = (
        f"A shop receives {boxes} boxes with {per_box} {item} in each box. It sells "
        f"{sold} {item}. How many {item} are left?"
    )
    steps = [
        f"The shop receives {_calc(f'{boxes}*{per_box}', total)} {item}.",
        f"It has {_calc(f'{total}-{sold}', left)} {item} left.",
    ]
    return question, steps, left


def three_day_total(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    monday = rng.randint(5, 30)
    tuesday = monday + rng.randint(2, 15)
    wednesday_factor = 2
    wednesday = tuesday * wednesday_factor
    total = monday + tuesday + wednesday
    question = (
        f"{name} reads {monday} pages on Monday, {tuesday - monday} more pages on Tuesday "
        f"than on Monday, and twice as many pages on Wednesday as on Tuesday. How many "
        f"pages does {name} read in the three days?"
    )
    steps = [
        f"On Tuesday {name} reads {_calc(f'{monday}+{tuesday - monday}', tuesday)} pages.",
        f"On Wednesday {name} reads {_calc(f'{tuesday}*{wednesday_factor}', wednesday)}.",
        f"In total {_calc(f'{monday}+{tuesday}+{wednesday}', total)} pages.",
    ]
    return question, steps, total


def hourly_wage(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    wage, hours, overtime, bonus = (
        rng.randint(10, 30),
        rng.randint(10, 40),
        rng.randint(1, 8),
        rng.randint(0, 5) * 10,
    )
    overtime_wage = wage * 2
    base = wage * hours
    extra = overtime_wage * overtime
    total = base + extra + bonus
    question = (
        f"{name} earns ${wage} per hour and double that for overtime. This week {name} "
        f"worked {hours} regular hours and {overtime} overtime hours and got a ${bonus} "
        f"bonus. How many dollars did {name} earn this week?"
    )
    steps = [
        f"Regular pay is {_calc(f'{wage}*{hours}', base)} dollars.",
        (
            f"Overtime pays {_calc(f'{wage}*2', overtime_wage)} per hour, so "
            f"{_calc(f'{overtime_wage}*{overtime}', extra)} dollars."
        ),
        f"Total pay is {_calc(f'{base}+{extra}+{bonus}', total)} dollars.",
    ]
    return question, steps, total


def recipe_scaling(rng: random.Random) -> Problem:
    servings, flour_per = rng.randint(2, 6), rng.randint(50, 150)
    factor = rng.randint(2, 5)
    new_servings = servings * factor
    flour = flour_per * servings * factor
    question = (
        f"A recipe for {servings} servings uses {flour_per * servings} grams of flour. "
        f"How many grams of flour are needed for {new_servings} servings?"
    )
    steps = [
        f"The recipe is scaled by {_calc(f'{new_servings}/{servings}', factor)}.",
        f"The flour needed is {_calc(f'{flour_per * servings}*{factor}', flour)} grams.",
    ]
    return question, steps, flour


TEMPLATES: list[Callable[[random.Random], Problem]] = [
    buy_and_change,
    share_equally,
    weekly_savings,
    rectangle_area,
    speed_distance,
    percent_discount,
    age_puzzle,
    boxes_and_leftovers,
    three_day_total,
    hourly_wage,
    recipe_scaling,
]


def generate_rows(count: int, rng: random.Random) -> list[dict[str, str]]:
    """Cycle through the templates so every split covers every kind of problem."""
    rows = []
    for index in range(count):
        question, steps, answer = TEMPLATES[index % len(TEMPLATES)](rng)
        rows.append({"question": question, "answer": "\n".join(steps) + f"\n#### {answer}"})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    rng = random.Random(SEED)
    here = Path(__file__).parent
    write_jsonl(here / "train.jsonl", generate_rows(TRAIN_SIZE, rng))
    write_jsonl(here / "test.jsonl", generate_rows(TEST_SIZE, rng))


if __name__ == "__main__":
    main()
