"""Built-in instructions for self-distillation: task templates crossed with topics.

The target answers them itself (sampled through the engine's batched `LLM.chat`), so
the head learns the target's own chat distribution. Evaluation prompts use topics no
training prompt uses: a topic goes to the evaluation split when a stable hash of it
lands in one bucket of ten (training.data.is_eval_source).
"""

from __future__ import annotations

from training.data import is_eval_source

TEMPLATES = (
    "Explain {t} to a beginner in a short paragraph.",
    "List five facts about {t}.",
    "Write a Python function related to {t}, with a docstring.",
    "Rewrite this sentence more formally: '{t} is pretty cool and lots of people like it.'",
    "Translate into French: 'I am reading a book about {t}.'",
    "Continue the story: 'The morning I first learned about {t},'",
    "Give three steps to get started with {t}.",
    "Summarise the history of {t} in three sentences.",
    "What are the pros and cons of {t}?",
    "Write a haiku about {t}.",
    "Answer briefly: why does {t} matter?",
    "Compare {t} with something similar, in two sentences.",
)
TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "sorting algorithms",
    "the water cycle", "volcanoes", "jazz music", "the stock market", "honeybees",
    "machine learning", "the Roman Empire", "climate change", "chess", "vaccines",
    "the internet", "coffee", "electric cars", "the moon landing", "recycling",
    "the human heart", "Shakespeare", "gravity", "rainforests", "cryptography",
    "the printing press", "soccer", "earthquakes", "bread baking", "solar panels",
    "the Great Wall of China", "octopuses", "prime numbers", "democracy", "glaciers",
    "the piano", "antibiotics", "the Silk Road", "robots", "sleep", "tea",
    "linked lists", "the Amazon river", "dinosaurs", "meditation", "bicycles",
    "the periodic table", "origami", "hurricanes", "the Renaissance", "databases",
)


def instructions(split: str) -> list[str]:
    """Every template for every topic of the split (training: 47 topics, 564 prompts),
    ordered so that any prefix spreads over the topics: the n-th is template n mod 12
    on a topic that moves on by one with each template and each round of them. Served
    figures and benchmarks take a prefix; topic by topic, the first 12 held-out prompts
    were one topic, and two heads trained alike read 0.18 of mean acceptance length
    apart there against 0.035 on all 36 (README)."""
    want_eval = split == "eval"
    topics = [topic for topic in TOPICS if is_eval_source(topic) == want_eval]
    return [template.format(t=topics[(i + r) % len(topics)])
            for r in range(len(topics)) for i, template in enumerate(TEMPLATES)]


# ---- training conversations: many more task kinds, text from the machine, turns ----

TASK_TEMPLATES = (
    "Write a short dialogue between a teacher and a student about {t}.",
    "Write a four-sentence story in which {t} plays a part.",
    "Give five tips for someone learning about {t}.",
    "What is a common misconception about {t}? Explain why it is wrong.",
    "Explain {t} as if to a ten-year-old.",
    "Write an outline for a short essay on {t}.",
    "Write three quiz questions about {t}, with their answers.",
    "Explain {t} with an everyday analogy.",
    "How might {t} change in the next twenty years?",
    "Write a short email inviting a colleague to a talk about {t}.",
    "Define {t} in one sentence, then give an example.",
    "Write a product description for a board game about {t}.",
    "Summarise what a newcomer should know about {t} in five bullet points.",
    "Write a limerick about {t}.",
    "Describe a typical day of someone whose job involves {t}.",
    "Argue for and against spending public money on {t}, one paragraph each.",
)
MORE_TOPICS = (
    "bees' dances", "the immune system", "plate tectonics", "the Ottoman Empire",
    "quantum computing", "recursion", "hash tables", "rivers", "the Olympic Games",
    "impressionist painting", "yoga", "compound interest", "inflation", "wind turbines",
    "nuclear fusion", "the Moon's phases", "penguins", "the Byzantine Empire", "opera",
    "electric guitars", "public libraries", "the metric system", "ancient Egypt",
    "coral reefs", "the blockchain", "neural networks", "the Cold War", "marathons",
    "composting", "the microscope", "weather forecasting", "fungi", "the Vikings",
    "street food", "gardening", "photography", "lighthouses", "submarines", "tornadoes",
    "the English language", "calculus", "probability", "graph theory", "compilers",
    "operating systems", "the web browser", "open source software", "unit testing",
    "version control", "spreadsheets", "the printing of money", "tides", "deserts",
    "migratory birds", "wolves", "elephants", "the Arctic", "chocolate", "cheese making",
    "the violin", "film editing", "video games", "board games", "mountaineering",
    "sailing", "trains", "airports", "bridges", "skyscrapers", "city planning",
    "water treatment",
    "first aid", "nutrition", "running shoes", "the alphabet", "maps", "satellites",
    "Mars", "comets", "the speed of light", "magnets", "batteries", "semiconductors",
)
CODE_LANGUAGES = ("Python", "JavaScript", "C", "Rust", "Go", "SQL", "Bash", "Java")
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a text",
    "returns the largest element of a list", "merges two sorted lists",
    "computes the factorial of n", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "finds the average of an array of numbers",
    "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
    "sorts a list of names alphabetically", "reads a file and prints its line count",
)
REASONING = (
    "Solve step by step: {a} boxes each hold {b} books about {t}. {c} books are lent "
    "out. How many books remain?",
    "Solve step by step: a club about {t} has {a} members. Each brings {b} guests and "
    "{c} guests leave early. How many people stay?",
    "Think step by step: a course on {t} has {a} lessons of {b} minutes. How many hours "
    "is that, if {c} lessons are skipped?",
)
PASSAGE_TEMPLATES = (
    "Summarise this text in two sentences:\n\n{p}",
    "What is the main purpose described in this text?\n\n{p}",
    "List the key terms in this text, one per line:\n\n{p}",
    "Explain this documentation to a beginner:\n\n{p}",
)
FOLLOW_UPS = (
    "Now summarise your answer in one sentence.",
    "Can you give a concrete example?",
    "Explain that more simply.",
    "What is the most important point, and why?",
    "Rewrite your answer as a bulleted list.",
    "Thank you! Can you add one more detail?",
)


def _topics(split: str) -> list[str]:
    want_eval = split == "eval"
    return [t for t in TOPICS + MORE_TOPICS if is_eval_source(t) == want_eval]


def passages(split: str, max_chars: int = 600) -> list[tuple[str, str]]:
    """(source, text): the opening of each standard-library module's docstring that
    says something, split by the module file's hash as the code windows are, so no
    text of an evaluation file is trained on."""
    import ast

    from training.data import stdlib_files

    want_eval = split == "eval"
    found = []
    for path in stdlib_files():
        if is_eval_source(path.name) != want_eval:
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8",
                                                             errors="replace")))
        except (SyntaxError, ValueError):
            continue
        if doc and len(doc) >= 200:
            found.append((path.name, doc[:max_chars].rsplit(" ", 1)[0]))
    return found


def first_turns(split: str, seed: int) -> list[str]:
    """Every single-turn training instruction of `split`, shuffled by `seed`: the
    built-in templates and the task kinds over the split's topics, code tasks in
    several languages, small reasoning problems, and tasks on text from the machine."""
    import random

    rng = random.Random(seed)
    topics = _topics(split)
    prompts = [template.format(t=topic) for topic in topics
               for template in TEMPLATES + TASK_TEMPLATES]
    prompts += [f"Write a {lang} function that {task}." for lang in CODE_LANGUAGES
                for task in CODE_TASKS]
    prompts += [template.format(t=topic, a=rng.randint(3, 12), b=rng.randint(2, 9),
                                c=rng.randint(1, 5))
                for topic in topics for template in REASONING]
    prompts += [template.format(p=text) for _, text in passages(split)
                for template in PASSAGE_TEMPLATES]
    prompts = sorted(set(prompts))  # one order for a seed, whatever the set's
    rng.shuffle(prompts)
    return prompts


def follow_up(prompt: str, answer: str, index: int) -> list[dict[str, str]]:
    """A second turn: the target's own answer in the context, then a follow-up."""
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer},
            {"role": "user", "content": FOLLOW_UPS[index % len(FOLLOW_UPS)]}]


def held_out_turns(seed: int) -> list[str]:
    """The first turns of the held-out split that no training first turn repeats (a
    code task names no topic, so `first_turns` lists it in both), in `first_turns`'
    order: what the held-out agreement is measured on."""
    train = set(first_turns("train", seed))
    return [p for p in first_turns("eval", seed) if p not in train]
