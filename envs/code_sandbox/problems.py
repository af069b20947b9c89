"""Seeded generator of small function-writing problems with hidden tests.

``make_problem(seed)`` picks a family (sum of multiples, count chars, reverse words, clamp,
fizzbuzz-like, caesar shift, digit sum in a base, ...), its parameters, the function name and
the test inputs from ``random.Random(seed)``: the same seed gives the same problem everywhere.
The generator does not depend on the range, the split is a convention: train on seeds below
1_000_000, evaluate on seeds at or above it (held-out). Families repeat across seeds; their
parameters and tests make the instances distinct.

Every problem carries a reference solution (``reference``, Python source); expected outputs are
computed by running it here, in the trusted process, so a problem can never disagree with it.
Prompts are short printable ASCII for small models.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field

LOWER = string.ascii_lowercase
N_TESTS = 6


@dataclass
class Problem:
    seed: int
    family: str
    func: str
    signature: str  # e.g. "def sum_div(xs):"
    statement: str  # one sentence
    reference: str  # a correct solution (source)
    inputs: list  # argument lists, one per hidden test
    expected: list = field(default_factory=list)

    @property
    def prompt(self) -> str:
        return f'{self.signature}\n    """{self.statement}"""'

    def to_json(self) -> dict:
        return {
            "seed": self.seed,
            "family": self.family,
            "func": self.func,
            "signature": self.signature,
            "statement": self.statement,
            "inputs": self.inputs,
            "expected": self.expected,
        }


def _ints(rng, n_lo=0, n_hi=8, lo=-20, hi=50):
    return [rng.randint(lo, hi) for _ in range(rng.randint(n_lo, n_hi))]


def _word(rng, lo=1, hi=6, alphabet=LOWER):
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _sentence(rng, sep=" ", n_lo=1, n_hi=5):
    return sep.join(_word(rng) for _ in range(rng.randint(n_lo, n_hi)))


def sum_divisible(rng):
    k = rng.randint(2, 9)
    name = rng.choice(["sum_div", "total_div", "add_multiples"])
    inputs = [[[]], [[k, 2 * k, 1]]] + [[_ints(rng)] for _ in range(N_TESTS - 2)]
    return (
        name,
        "xs",
        f"Return the sum of the numbers in the list xs that are divisible by {k}.",
        f"def {name}(xs):\n    return sum(x for x in xs if x % {k} == 0)\n",
        inputs,
    )


def count_chars(rng):
    chars = rng.choice(["aeiou", "xyz", "".join(sorted(rng.sample(LOWER, 3)))])
    name = rng.choice(["count_chars", "how_many", "tally"])
    inputs = [[""], [chars]] + [[_sentence(rng)] for _ in range(N_TESTS - 2)]
    return (
        name,
        "s",
        f"Return how many characters of the string s are one of '{chars}'.",
        f"def {name}(s):\n    return sum(1 for c in s if c in {chars!r})\n",
        inputs,
    )


def reverse_words(rng):
    sep = rng.choice([" ", ",", "-", ";"])
    name = rng.choice(["reverse_words", "flip_words", "backwards"])
    inputs = [["a"]] + [[_sentence(rng, sep, 2, 5)] for _ in range(N_TESTS - 1)]
    return (
        name,
        "s",
        f"Return s with its words in reverse order. Words are separated by '{sep}'.",
        f"def {name}(s):\n    return {sep!r}.join(s.split({sep!r})[::-1])\n",
        inputs,
    )


def clamp(rng):
    lo = rng.randint(-50, 40)
    hi = lo + rng.randint(1, 60)
    name = rng.choice(["clamp", "limit", "bound"])
    inputs = [[lo - 1], [hi + 1], [lo], [hi]] + [[rng.randint(lo - 30, hi + 30)] for _ in range(N_TESTS - 4)]
    return name, "x", f"Return {lo} if x < {lo}, {hi} if x > {hi}, else x.", f"def {name}(x):\n    return max({lo}, min({hi}, x))\n", inputs


def fizzbuzz(rng):
    a, b = rng.sample(range(2, 8), 2)
    wa, wb = rng.sample(["Fizz", "Buzz", "Bang", "Pop", "Zap", "Ping"], 2)
    name = rng.choice(["fizz", "say", "shout"])
    inputs = [[a * b], [a], [b], [1]] + [[rng.randint(1, 100)] for _ in range(N_TESTS - 4)]
    return (
        name,
        "n",
        (f"Return '{wa}{wb}' if n is divisible by {a} and {b}, '{wa}' if only by {a}, '{wb}' if only by {b}, else str(n)."),
        (f"def {name}(n):\n    s = ({wa!r} if n % {a} == 0 else '') + ({wb!r} if n % {b} == 0 else '')\n    return s or str(n)\n"),
        inputs,
    )


def count_greater(rng):
    t = rng.randint(-10, 30)
    name = rng.choice(["count_above", "n_greater", "above"])
    inputs = [[[]], [[t, t + 1]]] + [[_ints(rng)] for _ in range(N_TESTS - 2)]
    return (
        name,
        "xs",
        f"Return how many numbers in the list xs are greater than {t}.",
        f"def {name}(xs):\n    return sum(1 for x in xs if x > {t})\n",
        inputs,
    )


def caesar(rng):
    k = rng.randint(1, 25)
    name = rng.choice(["shift", "caesar", "rotate"])
    inputs = [[""], ["z"]] + [[_sentence(rng) + rng.choice(["", "!", " 42"])] for _ in range(N_TESTS - 2)]
    return (
        name,
        "s",
        f"Shift each lowercase letter of s forward by {k} in the alphabet (z wraps to a). Keep other characters.",
        (f"def {name}(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)\n"),
        inputs,
    )


def digit_sum(rng):
    base = rng.randint(2, 10)
    name = rng.choice(["digit_sum", "digits_total", "dsum"])
    inputs = [[0], [base - 1], [base]] + [[rng.randint(1, 5000)] for _ in range(N_TESTS - 3)]
    return (
        name,
        "n",
        f"Return the sum of the digits of the integer n >= 0 written in base {base}.",
        (f"def {name}(n):\n    t = 0\n    while n:\n        t += n % {base}\n        n //= {base}\n    return t\n"),
        inputs,
    )


def every_nth(rng):
    k = rng.randint(2, 4)
    start = rng.randint(0, k - 1)
    name = rng.choice(["every_nth", "pick", "stride"])
    inputs = [[[]]] + [[_ints(rng, 1, 10)] for _ in range(N_TESTS - 1)]
    return (
        name,
        "xs",
        f"Return the list of items of xs at index {start}, {start + k}, {start + 2 * k} and so on.",
        f"def {name}(xs):\n    return xs[{start}::{k}]\n",
        inputs,
    )


def polynomial(rng):
    a, b, c = rng.randint(1, 5), rng.randint(-5, 5), rng.randint(-9, 9)
    expr = f"{a}*x*x {'+' if b >= 0 else '-'} {abs(b)}*x {'+' if c >= 0 else '-'} {abs(c)}"
    name = rng.choice(["poly", "f", "evaluate"])
    inputs = [[0], [1], [-1]] + [[rng.randint(-20, 20)] for _ in range(N_TESTS - 3)]
    return name, "x", f"Return {expr} for the integer x.", f"def {name}(x):\n    return {expr}\n", inputs


def longest_run(rng):
    ch = rng.choice("abc")
    name = rng.choice(["longest_run", "max_streak", "run_length"])
    inputs = [[""], [ch * 3]] + [["".join(rng.choice("abc") for _ in range(rng.randint(1, 12)))] for _ in range(N_TESTS - 2)]
    return (
        name,
        "s",
        f"Return the length of the longest block of consecutive '{ch}' characters in s (0 if none).",
        (
            f"def {name}(s):\n    best = cur = 0\n    for c in s:\n        cur = cur + 1 if c == {ch!r} else 0\n"
            f"        best = max(best, cur)\n    return best\n"
        ),
        inputs,
    )


def words_of_length(rng):
    n = rng.randint(2, 5)
    name = rng.choice(["count_words", "n_words", "words_len"])
    inputs = [[""]] + [[_sentence(rng, " ", 1, 7)] for _ in range(N_TESTS - 1)]
    return (
        name,
        "s",
        f"Return how many space-separated words of s have exactly {n} letters.",
        f"def {name}(s):\n    return sum(1 for w in s.split() if len(w) == {n})\n",
        inputs,
    )


def remove_chars(rng):
    chars = "".join(sorted(rng.sample(LOWER[:8], 2)))
    name = rng.choice(["strip_chars", "remove", "without"])
    inputs = [[""], [chars]] + [[_word(rng, 2, 12, LOWER[:10])] for _ in range(N_TESTS - 2)]
    return (
        name,
        "s",
        f"Return s without any of the characters in '{chars}'.",
        f"def {name}(s):\n    return ''.join(c for c in s if c not in {chars!r})\n",
        inputs,
    )


def is_sorted(rng):
    order, op = rng.choice([("non-decreasing", "<="), ("non-increasing", ">="), ("strictly increasing", "<")])
    name = rng.choice(["is_sorted", "in_order", "ordered"])
    inputs = [[[]], [[3, 3]], [[1, 2, 3]], [[3, 2, 1]]]
    inputs += [[sorted(_ints(rng, 2, 6, 0, 9), reverse=op == ">=")], [_ints(rng, 2, 6, 0, 9)]]
    return (
        name,
        "xs",
        f"Return True if the list xs is in {order} order, else False.",
        f"def {name}(xs):\n    return all(a {op} b for a, b in zip(xs, xs[1:]))\n",
        inputs,
    )


def running_total(rng):
    k = rng.randint(1, 3)
    name = rng.choice(["running_sum", "prefix", "cumulative"])
    inputs = [[[]]] + [[_ints(rng, 1, 7, -9, 9)] for _ in range(N_TESTS - 1)]
    return (
        name,
        "xs",
        f"Return the list whose item i is {k} times the sum of xs[0] .. xs[i].",
        (f"def {name}(xs):\n    out, t = [], 0\n    for x in xs:\n        t += x\n        out.append({k} * t)\n    return out\n"),
        inputs,
    )


FAMILIES = {
    f.__name__: f
    for f in (
        sum_divisible,
        count_chars,
        reverse_words,
        clamp,
        fizzbuzz,
        count_greater,
        caesar,
        digit_sum,
        every_nth,
        polynomial,
        longest_run,
        words_of_length,
        remove_chars,
        is_sorted,
        running_total,
    )
}


def make_problem(seed: int, families: list[str] | None = None) -> Problem:
    """The problem of ``seed`` (optionally among some families only)."""
    names = list(families or FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown problem families {unknown}; known: {', '.join(FAMILIES)}")
    rng = random.Random(seed)
    family = names[rng.randrange(len(names))]
    func, args, statement, reference, inputs = FAMILIES[family](rng)
    problem = Problem(seed, family, func, f"def {func}({args}):", statement, reference, inputs)
    problem.expected = [json.loads(json.dumps(v)) for v in run_reference(problem)]
    return problem


def run_reference(problem: Problem) -> list:
    ns: dict = {}
    exec(compile(problem.reference, f"<reference {problem.family}>", "exec"), ns)  # our own source, trusted
    fn = ns[problem.func]
    return [fn(*json.loads(json.dumps(args))) for args in problem.inputs]
