"""Varied instruct prompts for the ``chat`` benchmark workload (questions, coding, writing,
lists, explanations): each becomes one user turn rendered with the model's chat template."""
from __future__ import annotations

# The correctness oracle's prompts (tests/reference.py) and the GPU bf16-vs-fp32 comparison's.
ORACLE_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences what a hash table is.",
    "List three fruits that are red.",
    "How many legs does a spider have? Answer and explain.",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Give me two tips for sleeping better.",
)

CHAT_PROMPTS: tuple[str, ...] = (
    # questions
    "What is the capital of Australia, and why is it not Sydney?",
    "How many bones are in the adult human body?",
    "Why is the sky blue?",
    "What causes the seasons on Earth?",
    "Who wrote 'Pride and Prejudice', and when was it published?",
    "What is the difference between weather and climate?",
    "How do vaccines train the immune system?",
    "What is the boiling point of water at the top of Mount Everest?",
    # coding
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "Explain what this Python code does: `print(sum(x * x for x in range(10)))`.",
    "Write a JavaScript function that removes duplicate values from an array.",
    "How do I read a CSV file with pandas and print the first five rows?",
    "Write a bash one-liner that counts the lines in every .txt file in a folder.",
    "What is the difference between a list and a tuple in Python?",
    "Write a recursive function in Python that computes the nth Fibonacci number, then make it fast.",
    # writing
    "Write a short poem about autumn leaves.",
    "Write a polite email asking my manager for a day off next Friday.",
    "Write a four-sentence story about a robot who learns to paint.",
    "Write a product description for a reusable water bottle.",
    "Write a haiku about the ocean at night.",
    "Write a short motivational message for a friend starting a new job.",
    "Write a limerick about a cat who loves cheese.",
    "Summarize the plot of 'Romeo and Juliet' in three sentences.",
    # lists
    "List five healthy breakfast ideas.",
    "Give me a packing list for a weekend camping trip.",
    "List the planets of the solar system in order from the Sun.",
    "Name three famous painters from the Renaissance and one work by each.",
    "Give me seven tips for studying more effectively.",
    "List four ways to reduce plastic waste at home.",
    "What are the main food groups? List them with an example of each.",
    "Suggest five names for a small bakery.",
    # explanations
    "Explain how a hash table works to a beginner.",
    "Explain photosynthesis in simple terms.",
    "Explain the difference between RAM and storage in a computer.",
    "Explain what inflation is and why it matters.",
    "Explain how a bicycle stays upright when it moves.",
    "Explain recursion with an everyday example.",
    "Explain why we have leap years.",
    "Explain the rules of chess in a short paragraph.",
    "Translate 'Where is the train station?' into French, Spanish and German.",
    "What are the pros and cons of working from home?",
)
