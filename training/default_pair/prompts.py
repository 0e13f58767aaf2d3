"""The prompts of the default pair's build (its step 1).

Lists of (kind, text), kind "plain" (raw text) or "chat" (the target's chat template): three
template sets over fixed slot lists (``build_prompts``; about 12% of the slot values are held
out: the first set's prompts with them are the held-out evaluation set, the other sets drop
them) and a fourth set of prompts about single words of the target's vocabulary
(``word_prompts``); the CLI's demo prompts (``DEMO_PROMPTS``) are in none of the training sets.
``encode`` gives a prompt's token ids as the target reads it.
"""

from __future__ import annotations

import hashlib
import random
import re


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
STORY_OPENINGS = ["Once upon a time, in a small village", "Once upon a time there was a",
                  "Long ago, in a kingdom far away,", "It was a dark and stormy night", "There once lived a",
                  "In a land far, far away", "The old man looked at the sea and", "Every morning, the little girl",
                  "Once upon a time, a young dragon", "The year was 2150, and", "Deep in the forest, there lived",
                  "Once upon a time, a curious cat", "On the first day of school,", "The last train left the station",
                  "Once, a brave knight", "Many years ago, a fisherman", "In the middle of the desert,",
                  "The robot opened its eyes and"]
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
GROUPS_C = ["longest rivers in the world", "largest animals on Earth", "phases of the moon",
            "stages of the water cycle", "layers of the Earth", "types of renewable energy", "main parts of a plant",
            "vitamins the body needs", "organs of the digestive system", "Great Lakes",
            "seven wonders of the ancient world", "main gases in the air", "parts of speech",
            "steps of the scientific method", "main branches of science", "largest cities in Europe",
            "main types of triangles", "four directions of a compass", "days of the week", "months of the year",
            "main musical instruments of an orchestra", "types of galaxies", "members of the cat family",
            "main types of government", "parts of a flower", "main human blood vessels", "largest deserts in the world",
            "tallest mountains on Earth"]
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
