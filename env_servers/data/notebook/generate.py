"""Generate the CSV datasets and data-analysis tasks shipped in this folder.

Run `python env_servers/data/notebook/generate.py` to rewrite every `<dataset>/*.csv` and
`tasks.jsonl`. The output is a pure function of SEED.

Each task names its split, a dataset folder (copied whole into the episode's working directory), the CSV
files in it, a question, and a reference `solution`: pandas code that prints the answer. The
`answer` field is whatever that code prints, so the answers are exact by construction.
"""

import contextlib
import csv
import io
import json
import os
import random
from pathlib import Path

SEED = 7919
HERE = Path(__file__).parent

# Answers rounded to 2 decimals are accepted within half a unit of the last place, plus slack
# for an agent that rounds a little differently.
ROUNDED_TOLERANCE = 0.01

# Every TEST_EVERY-th task is held out in the "test" split; the rest form "train".
TEST_EVERY = 5


def write_csv(path: Path, header: list[str], rows: list[list[object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


def make_sales(rng: random.Random) -> None:
    regions, products = ["North", "South", "East", "West"], ["A", "B", "C", "D", "E"]
    prices = {"A": 4.5, "B": 12.0, "C": 7.25, "D": 20.0, "E": 2.75}
    rows = []
    for order_id in range(1, 121):
        product = rng.choice(products)
        rows.append(
            [
                order_id,
                rng.choice(regions),
                product,
                rng.randint(1, 25),
                prices[product],
                f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            ]
        )
    write_csv(
        HERE / "sales" / "orders.csv",
        ["order_id", "region", "product", "quantity", "unit_price", "date"],
        rows,
    )


def make_clinical(rng: random.Random) -> None:
    rows = []
    for patient_id in range(1, 81):
        treatment = rng.choice(["drug", "placebo"])
        baseline = rng.randint(130, 175)
        drop = rng.randint(5, 25) if treatment == "drug" else rng.randint(-5, 10)
        rows.append(
            [
                f"P{patient_id:03d}",
                rng.randint(25, 80),
                rng.choice(["F", "M"]),
                treatment,
                baseline,
                baseline - drop,
                rng.choice(["yes", "no"]),
            ]
        )
    write_csv(
        HERE / "clinical" / "patients.csv",
        ["patient_id", "age", "sex", "treatment", "baseline_bp", "followup_bp", "smoker"],
        rows,
    )


def make_weather(rng: random.Random) -> None:
    stations = [
        ["S1", "Harbor", 5],
        ["S2", "Ridge", 850],
        ["S3", "Valley", 220],
        ["S4", "Summit", 1900],
        ["S5", "Plains", 310],
    ]
    write_csv(HERE / "weather" / "stations.csv", ["station_id", "name", "elevation_m"], stations)
    rows = []
    for station_id, _, elevation in stations:
        for day in range(1, 31):
            temp = round(rng.gauss(18 - elevation / 150, 3), 1)
            rain = round(max(0.0, rng.gauss(2, 4)), 1)
            rows.append([station_id, day, temp, rain])
    write_csv(
        HERE / "weather" / "readings.csv", ["station_id", "day", "temp_c", "rainfall_mm"], rows
    )


def make_genes(rng: random.Random) -> None:
    genes = ["TP53", "BRCA1", "MYC", "EGFR", "GAPDH", "ACTB", "KRAS", "PTEN"]
    rows = []
    for gene in genes:
        base = rng.uniform(2, 12)
        effect = rng.uniform(-3, 3)
        for condition, shift in (("control", 0.0), ("treated", effect)):
            for replicate in (1, 2, 3):
                rows.append(
                    [gene, condition, replicate, round(base + shift + rng.gauss(0, 0.4), 3)]
                )
    write_csv(
        HERE / "genes" / "expression.csv", ["gene", "condition", "replicate", "expression"], rows
    )


# (dataset, files, question, solution, tolerance or None for an exact match)
TASKS: list[tuple[str, list[str], str, str, float | None]] = [
    (
        "sales",
        ["orders.csv"],
        "How many orders are in orders.csv?",
        "import pandas as pd\ndf = pd.read_csv('orders.csv')\nprint(len(df))",
        None,
    ),
    (
        "sales",
        ["orders.csv"],
        "How many orders were placed in the North region?",
        "import pandas as pd\ndf = pd.read_csv('orders.csv')\nprint((df.region == 'North').sum())",
        None,
    ),
    (
        "sales",
        ["orders.csv"],
        "What is the mean quantity per order for product C? Round to 2 decimal places.",
        (
            "import pandas as pd\ndf = pd.read_csv('orders.csv')\n"
            "print(round(df[df['product'] == 'C'].quantity.mean(), 2))"
        ),
        ROUNDED_TOLERANCE,
    ),
    (
        "sales",
        ["orders.csv"],
        (
            "Revenue is quantity times unit_price. What is the total revenue of all orders? "
            "Round to 2 decimal places."
        ),
        (
            "import pandas as pd\ndf = pd.read_csv('orders.csv')\n"
            "print(round((df.quantity * df.unit_price).sum(), 2))"
        ),
        ROUNDED_TOLERANCE,
    ),
    (
        "sales",
        ["orders.csv"],
        "Revenue is quantity times unit_price. Which region has the highest total revenue?",
        (
            "import pandas as pd\ndf = pd.read_csv('orders.csv')\n"
            "df['revenue'] = df.quantity * df.unit_price\n"
            "print(df.groupby('region').revenue.sum().idxmax())"
        ),
        None,
    ),
    (
        "sales",
        ["orders.csv"],
        "Which product appears in the most orders?",
        (
            "import pandas as pd\ndf = pd.read_csv('orders.csv')\n"
            "print(df['product'].value_counts().idxmax())"
        ),
        None,
    ),
    (
        "sales",
        ["orders.csv"],
        "How many orders have a quantity of at least 20?",
        "import pandas as pd\ndf = pd.read_csv('orders.csv')\nprint((df.quantity >= 20).sum())",
        None,
    ),
    (
        "sales",
        ["orders.csv"],
        "How many orders were placed in June 2024 (month 06)?",
        (
            "import pandas as pd\ndf = pd.read_csv('orders.csv', parse_dates=['date'])\n"
            "print((df.date.dt.month == 6).sum())"
        ),
        None,
    ),
    (
        "clinical",
        ["patients.csv"],
        "How many patients received the drug?",
        (
            "import pandas as pd\ndf = pd.read_csv('patients.csv')\n"
            "print((df.treatment == 'drug').sum())"
        ),
        None,
    ),
    (
        "clinical",
        ["patients.csv"],
        "What is the median age of all patients?",
        "import pandas as pd\ndf = pd.read_csv('patients.csv')\nprint(df.age.median())",
        ROUNDED_TOLERANCE,
    ),
    (
        "clinical",
        ["patients.csv"],
        (
            "The blood pressure reduction is baseline_bp minus followup_bp. What is the mean reduction "
            "in the drug group? Round to 2 decimal places."
        ),
        (
            "import pandas as pd\ndf = pd.read_csv('patients.csv')\n"
            "drug = df[df.treatment == 'drug']\n"
            "print(round((drug.baseline_bp - drug.followup_bp).mean(), 2))"
        ),
        ROUNDED_TOLERANCE,
    ),
    (
        "clinical",
        ["patients.csv"],
        (
            "The blood pressure reduction is baseline_bp minus followup_bp. What is the mean reduction "
            "in the placebo group? Round to 2 decimal places."
        ),
        (
            "import pandas as pd\ndf = pd.read_csv('patients.csv')\n"
            "placebo = df[df.treatment == 'placebo']\n"
            "print(round((placebo.baseline_bp - placebo.followup_bp).mean(), 2))"
        ),
        ROUNDED_TOLERANCE,
    ),
    (
        "clinical",
        ["patients.csv"],
        "How many female smokers are older than 50?",
        (
            "import pandas as pd\ndf = pd.read_csv('patients.csv')\n"
            "print(((df.sex == 'F') & (df.smoker == 'yes') & (df.age > 50)).sum())"
        ),
        None,
    ),
    (
        "clinical",
        ["patients.csv"],
        (
            "What is the patient_id of the patient with the highest baseline_bp? If several share it, "
            "give the first one in file order."
        ),
        (
            "import pandas as pd\ndf = pd.read_csv('patients.csv')\n"
            "print(df.loc[df.baseline_bp.idxmax(), 'patient_id'])"
        ),
        None,
    ),
    (
        "clinical",
        ["patients.csv"],
        (
            "What fraction of patients are smokers? Give a number between 0 and 1 rounded to 2 decimal "
            "places."
        ),
        (
            "import pandas as pd\ndf = pd.read_csv('patients.csv')\n"
            "print(round((df.smoker == 'yes').mean(), 2))"
        ),
        ROUNDED_TOLERANCE,
    ),
    (
        "weather",
        ["stations.csv", "readings.csv"],
        "How many readings are in readings.csv?",
        "import pandas as pd\nprint(len(pd.read_csv('readings.csv')))",
        None,
    ),
    (
        "weather",
        ["stations.csv", "readings.csv"],
        (
            "What is the mean temperature (temp_c) at the station named Summit? Round to 2 decimal "
            "places."
        ),
        (
            "import pandas as pd\nst = pd.read_csv('stations.csv')\nrd = pd.read_csv('readings.csv')\n"
            "m = rd.merge(st, on='station_id')\nprint(round(m[m.name == 'Summit'].temp_c.mean(), 2))"
        ),
        ROUNDED_TOLERANCE,
    ),
    (
        "weather",
        ["stations.csv", "readings.csv"],
        "Which station name has the largest total rainfall_mm over all days?",
        (
            "import pandas as pd\nst = pd.read_csv('stations.csv')\nrd = pd.read_csv('readings.csv')\n"
            "m = rd.merge(st, on='station_id')\nprint(m.groupby('name').rainfall_mm.sum().idxmax())"
        ),
        None,
    ),
    (
        "weather",
        ["stations.csv", "readings.csv"],
        "On how many station-days was rainfall_mm exactly 0?",
        "import pandas as pd\nrd = pd.read_csv('readings.csv')\nprint((rd.rainfall_mm == 0).sum())",
        None,
    ),
    (
        "weather",
        ["stations.csv", "readings.csv"],
        (
            "What is the mean temperature over all readings from stations above 500 m elevation? "
            "Round to 2 decimal places."
        ),
        (
            "import pandas as pd\nst = pd.read_csv('stations.csv')\nrd = pd.read_csv('readings.csv')\n"
            "m = rd.merge(st, on='station_id')\nprint(round(m[m.elevation_m > 500].temp_c.mean(), 2))"
        ),
        ROUNDED_TOLERANCE,
    ),
    (
        "weather",
        ["stations.csv", "readings.csv"],
        "What is the highest single temp_c reading at station S1?",
        (
            "import pandas as pd\nrd = pd.read_csv('readings.csv')\n"
            "print(rd[rd.station_id == 'S1'].temp_c.max())"
        ),
        ROUNDED_TOLERANCE,
    ),
    (
        "genes",
        ["expression.csv"],
        "How many distinct genes are in expression.csv?",
        "import pandas as pd\ndf = pd.read_csv('expression.csv')\nprint(df.gene.nunique())",
        None,
    ),
    (
        "genes",
        ["expression.csv"],
        "What is the mean expression of MYC in the treated condition? Round to 2 decimal places.",
        (
            "import pandas as pd\ndf = pd.read_csv('expression.csv')\n"
            "print(round(df[(df.gene == 'MYC') & (df.condition == 'treated')].expression.mean(), 2))"
        ),
        ROUNDED_TOLERANCE,
    ),
    (
        "genes",
        ["expression.csv"],
        (
            "For each gene, take the mean treated expression minus the mean control expression. Which "
            "gene has the largest increase?"
        ),
        (
            "import pandas as pd\ndf = pd.read_csv('expression.csv')\n"
            "means = df.pivot_table(index='gene', columns='condition', values='expression')\n"
            "print((means.treated - means.control).idxmax())"
        ),
        None,
    ),
    (
        "genes",
        ["expression.csv"],
        (
            "For each gene, take the mean treated expression minus the mean control expression. How "
            "many genes have a decrease of more than 1?"
        ),
        (
            "import pandas as pd\ndf = pd.read_csv('expression.csv')\n"
            "means = df.pivot_table(index='gene', columns='condition', values='expression')\n"
            "print(((means.treated - means.control) < -1).sum())"
        ),
        None,
    ),
]


def run_solution(dataset: str, solution: str) -> str:
    """Execute a reference solution inside its dataset folder and return what it prints."""
    printed = io.StringIO()
    previous = Path.cwd()
    os.chdir(HERE / dataset)
    try:
        with contextlib.redirect_stdout(printed):
            exec(solution, {})  # noqa: S102 - trusted code written in this file
    finally:
        os.chdir(previous)
    return printed.getvalue().strip()


def main() -> None:
    rng = random.Random(SEED)
    make_sales(rng)
    make_clinical(rng)
    make_weather(rng)
    make_genes(rng)
    lines = []
    for index, (dataset, files, question, solution, tolerance) in enumerate(TASKS):
        task = {
            "id": f"{dataset}-{index:02d}",
            "dataset": dataset,
            "files": files,
            "split": "test" if index % TEST_EVERY == TEST_EVERY - 1 else "train",
            "question": question,
            "answer": run_solution(dataset, solution),
            "tolerance": tolerance,
            "solution": solution,
        }
        lines.append(json.dumps(task) + "\n")
    (HERE / "tasks.jsonl").write_text("".join(lines))


if __name__ == "__main__":
    main()
