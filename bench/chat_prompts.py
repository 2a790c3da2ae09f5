"""The chat requests the end-to-end benchmarks send: 64 everyday questions.

A mix of what a chat server sees: one-line facts, lists, explanations, small creative
tasks and a little code, so that answers (greedy, stopping at the model's end of turn)
range from a few tokens to the length cap.
"""

from __future__ import annotations

TOPICS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain gravity to a child.", "List three fruits and their colours.",
    "Give me a tip for staying focused.", "What is 12 times 7?",
    "Summarise Romeo and Juliet.", "Describe a cat in one paragraph.",
    "Why is the sky blue?", "Name three programming languages.",
    "How do plants make food?", "Write a limerick about a robot.",
    "What is a prime number?", "Suggest a name for a bakery.",
    "How far is the Moon?", "Tell me a fun fact about octopuses.",
    "What does a CPU do?", "Translate 'good morning' into Spanish.",
    "Write a short poem about autumn leaves.", "How many legs does a spider have?",
    "Give me three ideas for a rainy afternoon.", "What is the boiling point of water?",
    "Explain what a black hole is.", "Who wrote Pride and Prejudice?",
    "Write a Python function that reverses a string.", "What causes the seasons?",
    "Recommend a good habit for better sleep.", "What is photosynthesis in one sentence?",
    "Describe the taste of a lemon.", "How do airplanes stay in the air?",
    "Write a two-line rhyme about coffee.", "What is the largest ocean on Earth?",
    "Explain the difference between weather and climate.", "Name the planets of the solar system.",
    "What is a healthy breakfast?", "Tell me a joke about computers.",
    "How does a rainbow form?", "What year did humans first land on the Moon?",
    "Give me a recipe for a simple salad.", "What is the speed of light?",
    "Explain recursion with an example.", "Write a thank-you note to a teacher.",
    "Why do cats purr?", "What are the three states of matter?",
    "How can I save money each month?", "Describe a sunset over the mountains.",
    "What is the Pythagorean theorem?", "List five animals that live in the desert.",
    "What is an API?", "Write a motivational quote.",
    "How does the heart pump blood?", "What is the tallest mountain in the world?",
    "Explain what DNA is.", "Suggest a weekend hobby for a beginner.",
    "What is the difference between a virus and a bacterium?", "Write a tweet about spring.",
    "How do bees make honey?", "What is 15 percent of 200?",
    "Describe the water cycle.", "Name three famous painters.",
    "What is machine learning?", "Write a short story opening about a lighthouse.",
    "Why is exercise good for you?", "What language is spoken in Brazil?",
]


def chat_prompt_ids(tokenizer, topics: list[str] = TOPICS) -> list[list[int]]:
    """Each topic as one user turn of the model's chat template, ready to generate."""
    from freetoken_core.tokenizer import apply_chat_template

    return [tokenizer.encode(apply_chat_template(tokenizer, [{"role": "user", "content": t}]),
                             add_special_tokens=False) for t in topics]
