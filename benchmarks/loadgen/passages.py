"""Seeded passages of plain English and small Python functions, for workloads whose answers repeat their prompt.

A small instruction-tuned model quotes, edits and summarises text it can read: given a string of random words it
does not quote them but writes a sentence about them over and over, so a workload built on word strings measures
its loops, not what it takes from the prompt. These passages are grammatical sentences drawn from fixed templates
and word lists (every combination is plain prose), and the functions are short, well-formed Python.
"""

from __future__ import annotations

import numpy as np

_PLACES = (
    "the river town", "the hill village", "the harbour city", "the mountain pass", "the old mill", "the valley farm",
    "the market square", "the northern island", "the forest camp", "the stone bridge", "the school", "the library",
)  # fmt: skip
_NAMES = (
    "Alder Bend", "Marrow Point", "Easton Reach", "Holloway", "Brightwater", "Kestrel Ford", "Greyhaven", "Millbrook",
    "Oakridge", "Sandmere", "Thornfield", "Westcombe",
)  # fmt: skip
_PEOPLE = (
    "the fishermen", "the children", "the carpenters", "the council", "the teachers", "the farmers", "the traders",
    "the bakers", "the old keeper", "the young doctor", "the travellers", "the musicians",
)  # fmt: skip
_THINGS = (
    "new boats", "the bridge", "a wooden tower", "the harvest", "fresh bread", "the river wall", "a small school",
    "the winter stores", "a stone well", "the market stalls", "a long fence", "the lighthouse",
)  # fmt: skip
_TIMES = (
    "every spring", "each autumn", "before the first snow", "after the long rains", "in the early morning",
    "at the end of summer", "once a year", "during the festival", "late at night", "on market days",
)  # fmt: skip
_VERBS = ("built", "repaired", "painted", "carried", "counted", "guarded", "cleaned", "moved", "measured", "sold")
_ADJECTIVES = ("quiet", "busy", "narrow", "ancient", "windy", "crowded", "peaceful", "famous", "remote", "green")
_REASONS = (
    "the water rose", "the roads were closed", "the old one had worn out", "the visitors were coming",
    "the winters were hard", "the prices had doubled", "a storm had passed", "nobody else knew how",
)  # fmt: skip

_SENTENCES = (
    "{Place} of {name} was {adjective}, and {people} {verb} {thing} {time}.",
    "{People} {verb} {thing} {time} because {reason}.",
    "Nobody in {name} forgot the year {people} {verb} {thing}.",
    "{Time}, {people} of {name} met to decide who {verb} {thing}.",
    "It was {adjective} work, but {people} {verb} {thing} without complaint.",
    "When {reason}, {people} {verb} {thing} and waited.",
    "Visitors to {name} still talk about {thing} that {people} {verb} {time}.",
    "{Place} grew {adjective} {time}, since {people} {verb} {thing}.",
)

_FUNCTIONS = (
    ("def {name}({a}, {b}):\n"
     "    {result} = []\n"
     "    for {item} in {a}:\n"
     "        if {item} > {b}:\n"
     "            {result}.append({item})\n"
     "    return {result}\n"),
    ("def {name}({a}):\n"
     "    {result} = {{}}\n"
     "    for {item} in {a}:\n"
     "        {result}[{item}] = {result}.get({item}, 0) + 1\n"
     "    return {result}\n"),
    ("def {name}({a}, {b}):\n"
     "    {result} = 0\n"
     "    for {item} in range({b}):\n"
     "        {result} += {a}[{item}] * {a}[{item}]\n"
     "    return {result}\n"),
    ("def {name}({a}, {b}):\n"
     "    if not {a}:\n"
     "        return {b}\n"
     "    {result} = sorted({a})\n"
     "    {item} = len({result}) // 2\n"
     "    return {result}[{item}]\n"),
)  # fmt: skip
_FUNCTION_WORDS = ("count", "filter", "largest", "middle", "total", "scores", "values", "limit", "entry", "found")
_VARIABLES = ("items", "numbers", "limit", "default", "result", "seen", "value", "index", "total", "counts", "row")


def _pick(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    return options[int(rng.integers(len(options)))]


def sentence(rng: np.random.Generator) -> str:
    """One sentence from a template, its slots filled from the word lists."""
    place, people, time = _pick(rng, _PLACES), _pick(rng, _PEOPLE), _pick(rng, _TIMES)
    return _pick(rng, _SENTENCES).format(
        Place=place[0].upper() + place[1:],
        name=_pick(rng, _NAMES),
        adjective=_pick(rng, _ADJECTIVES),
        people=people,
        People=people[0].upper() + people[1:],
        verb=_pick(rng, _VERBS),
        thing=_pick(rng, _THINGS),
        time=time,
        Time=time[0].upper() + time[1:],
        reason=_pick(rng, _REASONS),
    )


def passage(rng: np.random.Generator, min_words: int, max_words: int) -> str:
    """Sentences until the passage has at least a number of words drawn from [min_words, max_words]."""
    target = int(rng.integers(min_words, max_words + 1))
    sentences: list[str] = []
    while sum(len(s.split()) for s in sentences) < target:
        sentences.append(sentence(rng))
    return " ".join(sentences)


def function(rng: np.random.Generator) -> tuple[str, str]:
    """A short Python function and its name."""
    first, second = rng.choice(len(_FUNCTION_WORDS), size=2, replace=False)
    name = f"{_FUNCTION_WORDS[int(first)]}_{_FUNCTION_WORDS[int(second)]}"
    a, b, result, item = (_VARIABLES[int(i)] for i in rng.choice(len(_VARIABLES), size=4, replace=False))
    return _pick(rng, _FUNCTIONS).format(name=name, a=a, b=b, result=result, item=item), name
