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
    """Every template for every topic of the split (training: 45 topics, 540 prompts)."""
    want_eval = split == "eval"
    return [template.format(t=topic) for topic in TOPICS
            if is_eval_source(topic) == want_eval for template in TEMPLATES]
