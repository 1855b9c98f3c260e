"""Synthetic instruction prompts for training Medusa heads by self-distillation.

Nothing is downloaded and no benchmark prompt is used: prompts are built from templates x
topic lists written here, covering the kinds of request Spec-Bench has (writing, roleplay,
reasoning, math, coding, extraction, stem, humanities, translation, summarization, qa,
math word problems and "answer from this passage" retrieval prompts). Passages for the
summarisation / extraction / passage-question prompts are composed from templates (news-like
reports with random names, places and numbers) or taken from local text: the docstrings of
Python's standard library and its ``pydoc_data`` help topics.

The base model answers these prompts itself (greedy); the heads learn to predict its own
continuation, which is what greedy verification accepts. The prompts only have to put the
model in the same "modes" as real requests; their facts need not be true.
"""
from __future__ import annotations

import importlib
import random
import re
import warnings

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
              "translation", "summarization", "qa", "math_reasoning", "rag")

TOPICS = [
    "a weekend trip to the mountains", "learning to play the piano", "the first day at a new job",
    "a small bakery in a busy city", "climate change and coastal towns", "the history of the bicycle",
    "a robot that learns to paint", "working from home", "a visit to a street food market", "urban gardening",
    "the importance of sleep", "a lost dog finding its way home", "space exploration", "renewable energy",
    "a family reunion", "the ocean at night", "a library that never closes", "social media and teenagers",
    "a marathon runner's last race", "the invention of the printing press", "a village without electricity",
    "electric cars", "a friendship between a cat and a crow", "volunteering at an animal shelter",
    "a city built on water", "the rise of online learning", "a chef who lost her sense of taste",
    "the benefits of reading every day", "a winter festival", "artificial intelligence in hospitals",
    "a train journey across Europe", "recycling plastic", "a young inventor", "the four seasons",
    "a job interview that went wrong", "saving money as a student", "a desert expedition",
    "honey bees and farming", "a museum of forgotten objects", "public transport in big cities",
    "a mysterious letter", "healthy breakfast ideas", "the life of a lighthouse keeper",
    "moving to a new country", "a football team's comeback", "the future of cities", "ancient Rome",
    "a garden in the middle of a desert", "the first smartphone", "a musician's world tour",
]

WRITING_FORMS = [
    "Write a short story about {t}.", "Compose an engaging blog post about {t}.",
    "Write a poem about {t}.", "Write a persuasive essay on {t}.", "Draft a professional email to your team about {t}.",
    "Write a speech for a school assembly about {t}.", "Write a diary entry about {t}.",
    "Write a product description for a board game about {t}.", "Write a news article about {t}.",
    "Write a letter to a friend describing {t}.", "Write a short screenplay scene about {t}.",
    "Compose a travel guide introduction about {t}.", "Write a limerick about {t}.",
    "Write a motivational message about {t}.", "Write an opening paragraph for a novel about {t}.",
    "Describe {t} in vivid detail, using all five senses.", "Write a haiku sequence about {t}.",
    "Write a short advertisement about {t}.", "Write a review of a book about {t}.",
    "Write a two-paragraph essay explaining why {t} matters.",
]

PERSONAS = [
    "a pirate captain", "Sherlock Holmes", "a medieval knight", "a friendly robot", "a famous chef",
    "a nervous astronaut", "a wise old wizard", "a sports commentator", "a detective in the 1920s",
    "a kindergarten teacher", "a grumpy cat", "Albert Einstein", "a tour guide in Paris", "a doctor",
    "a startup founder", "a time traveler from the year 3000", "a park ranger", "a stand-up comedian",
    "Shakespeare", "a news anchor", "a fitness coach", "a librarian", "a taxi driver in New York",
]
ROLE_QUESTIONS = [
    "What do you think about {t}?", "How would you spend a day off?", "What is the secret to happiness?",
    "Tell me about your greatest adventure.", "Give me advice about {t}.", "What makes a good leader?",
    "Describe your favourite meal.", "Why should I care about {t}?", "What is your biggest fear?",
    "Can you help me plan a birthday party?", "What would you change about the world?",
]
ROLE_FORMS = [
    "Pretend you are {p}. {q}", "Imagine you are {p}. Answer in character: {q}",
    "Act as {p} for the rest of this conversation. {q}", "You are {p}. Speak like {p} as much as possible. {q}",
]

NAMES = ["Alice", "Bob", "Carlos", "Diana", "Ethan", "Fatima", "George", "Hannah", "Ivan", "Julia", "Kenji",
         "Laura", "Mohamed", "Nina", "Oscar", "Priya", "Quinn", "Rosa", "Samuel", "Tara", "Umar", "Vera",
         "William", "Xia", "Yusuf", "Zoe"]
ITEMS = [("apples", 2), ("notebooks", 3), ("pencils", 1), ("cupcakes", 4), ("tickets", 12), ("books", 15),
         ("shirts", 20), ("plants", 8), ("candles", 5), ("toy cars", 6), ("bottles of juice", 3), ("eggs", 1)]
PLACES = ["Springfield", "Riverton", "Lakeside", "Oakville", "Maplewood", "Hillcrest", "Brookfield",
          "Fairview", "Greenfield", "Westport", "Northbridge", "Ashford", "Clearwater", "Stonebridge"]
ORGS = ["the city council", "a local hospital", "the regional university", "a technology company",
        "the national railway", "a small charity", "the football club", "the central bank",
        "a car manufacturer", "the public library", "an airline", "a supermarket chain"]


def _reasoning(r: random.Random) -> str:
    a, b, c, d = r.sample(NAMES, 4)
    n = r.randint(2, 9)
    forms = [
        f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
        f"If you overtake the person in position {n} of a race, what position are you in now?",
        f"{a} has {n} sisters. Each of the sisters has one brother. How many brothers does {a} have if {a} is a boy?",
        f"There are {n + 3} birds on a tree. A hunter shoots {n}. How many birds are left on the tree? Think carefully.",
        f"{a}, {b} and {c} each have a different pet: a dog, a cat and a fish. {a} does not have the dog. {b} has "
        f"the cat. Who has the fish?",
        "If all bloops are razzies and all razzies are lazzies, are all bloops definitely lazzies? Explain.",
        f"A clock shows 3:{15 + n:02d}. What is the angle between the hour and the minute hands?",
        f"{a} is the father of {b}. {b} is the mother of {c}. What is the relationship between {a} and {c}?",
        f"Four friends, {a}, {b}, {c} and {d}, sit in a row. {a} sits next to {b}, and {c} sits at the left end. "
        f"{d} is not next to {c}. Give one possible seating order.",
        f"If it takes {n} machines {n} minutes to make {n} widgets, how long would it take {n * 10} machines to "
        f"make {n * 10} widgets?",
        "Which word does not belong: apple, banana, carrot, grape? Explain why.",
        f"A farmer has {n * 5} sheep and all but {n} run away. How many are left?",
    ]
    return r.choice(forms)


def _math(r: random.Random) -> str:
    a, b, c = r.randint(2, 30), r.randint(2, 30), r.randint(31, 200)
    x1, y1, x2, y2, x3, y3 = (r.randint(-5, 6) for _ in range(6))
    forms = [
        f"Solve for x: {a}x + {b} = {c}.", f"What is the area of a rectangle with sides {a} cm and {b} cm?",
        f"The vertices of a triangle are at points ({x1}, {y1}), ({x2}, {y2}) and ({x3}, {y3}). What is the area "
        f"of the triangle?", f"Find the sum of the first {a + 10} positive integers.",
        f"What is {a} percent of {c}?", f"Simplify the fraction {a * 6}/{b * 6}.",
        f"Find the derivative of f(x) = {a}x^3 - {b}x + {c}.", f"What is the greatest common divisor of {a * 4} and {b * 6}?",
        f"If f(x) = {a}x^2 - {b}, what is f({r.randint(1, 5)})?", f"Solve the system: x + y = {a + b}, x - y = {a - b}.",
        f"A circle has a radius of {a} cm. What are its circumference and area?",
        f"When a number is divided by {a}, the remainder is {b % a}. What is the remainder when twice the number is "
        f"divided by {a}?", f"How many positive divisors does {a * b} have?",
        f"What is the probability of rolling a sum of {r.randint(3, 11)} with two fair dice?",
        f"Compute {a} * {b} + {c} - {a + b}.", f"Convert {c} degrees Fahrenheit to Celsius.",
    ]
    return r.choice(forms)


def _math_reasoning(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    (item, price), (item2, price2) = r.sample(ITEMS, 2)
    n, m, p = r.randint(2, 12), r.randint(2, 9), r.choice([10, 20, 25, 30, 40, 50])
    forms = [
        f"{a} buys {n} {item} at ${price} each and {m} {item2} at ${price2} each. How much does {a} spend in total?",
        f"{a} has {n * m} {item}. {a} gives {n} to {b} and then splits the rest equally among {m} friends. How many "
        f"does each friend get?",
        f"A store sells {item} for ${price * 10}. During a sale the price is reduced by {p}%. What is the sale price?",
        f"{a} runs {n} miles every day for {m} weeks. How many miles does {a} run in total?",
        f"{a} is {n * 3} years old. {b} is {m} years younger than twice {a}'s age. How old is {b}?",
        f"A train travels at {n * 10} miles per hour for {m} hours and then at {n * 5} miles per hour for {n} hours. "
        f"How far does it travel?",
        f"{a} earns ${n * 100} a week and saves {p}% of it. How many weeks does it take to save ${n * 100 * m}?",
        f"{a} bakes {n * 12} cookies. {b} eats {m} of them and {a} packs the rest into boxes of {n}. How many full "
        f"boxes are there?",
        f"The tickets for a trip cost {p}% more than the ${n * 40} hotel. How much do the trip and the hotel cost "
        f"together?",
        f"{a} reads {n * 5} pages on Monday and twice as many on Tuesday. If the book has {n * 5 * 3 + m * 10} pages, "
        f"how many pages are left?",
    ]
    return r.choice(forms)


CODING_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "finds the most common words in a text file", "merges two sorted lists", "removes duplicates from a list while "
    "keeping the order", "computes the factorial of a number recursively", "checks whether a string is a palindrome",
    "reads a CSV file and prints the average of a column", "implements binary search", "counts the vowels in a string",
    "finds the longest common prefix of a list of strings", "flattens a nested list", "sorts a list of dictionaries by "
    "a key", "implements a stack class with push, pop and peek", "validates an email address with a regular "
    "expression", "computes the median of two sorted arrays", "finds all pairs in a list that sum to a target",
    "converts a Roman numeral to an integer", "implements bubble sort", "returns the transpose of a matrix",
    "downloads nothing but parses a URL into its parts", "counts the lines of every text file in a directory",
    "implements a least-recently-used cache", "finds the k largest elements of a list", "checks balanced parentheses",
    "computes the edit distance between two strings", "generates all permutations of a list",
    "finds the shortest path in a graph with breadth-first search", "implements a simple linked list",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "Go", "Rust"]


def _coding(r: random.Random) -> str:
    task, lang = r.choice(CODING_TASKS), r.choice(LANGUAGES)
    forms = [f"Write a {lang} function that {task}.", f"Develop a {lang} program that {task}.",
             f"Implement a function in {lang} that {task}. Explain the time complexity.",
             f"Write a {lang} function that {task}, and add a few test cases."]
    if r.random() < 0.25:
        src = _docstring_function(r)
        if src:
            return f"Explain what the following Python function is for, based on its documentation:\n\n{src}"
    return r.choice(forms)


STEM_CONCEPTS = [
    ("quantum physics", "superposition"), ("biology", "photosynthesis"), ("chemistry", "chemical equilibrium"),
    ("physics", "the conservation of momentum"), ("computer science", "public-key cryptography"),
    ("astronomy", "black holes"), ("genetics", "CRISPR gene editing"), ("geology", "plate tectonics"),
    ("medicine", "how vaccines train the immune system"), ("ecology", "food webs"), ("physics", "entropy"),
    ("engineering", "how a bridge carries its load"), ("computer science", "how neural networks learn"),
    ("chemistry", "catalysts"), ("meteorology", "how hurricanes form"), ("physics", "special relativity"),
    ("biology", "natural selection"), ("mathematics", "prime numbers in cryptography"),
    ("neuroscience", "how memories are stored"), ("materials science", "superconductors"),
]
HUMANITIES = [
    "the causes of the First World War", "the correlation between inflation and unemployment",
    "how fiscal and monetary policy differ", "the influence of the Renaissance on modern art",
    "the main ideas of utilitarianism", "the role of religion in ancient Egypt", "the impact of the Industrial "
    "Revolution on workers", "why the Roman Empire declined", "the philosophy of Confucius", "the effects of "
    "globalisation on local cultures", "the importance of the Magna Carta", "how supply and demand set prices",
    "the legacy of the Silk Road", "the ethics of artificial intelligence", "the history of democracy in Athens",
    "the causes and effects of the Great Depression", "the role of museums in society", "existentialism",
    "the cultural impact of the printing press", "how language shapes thought",
]


def _stem(r: random.Random) -> str:
    field, concept = r.choice(STEM_CONCEPTS)
    return r.choice([f"In the field of {field}, what is {concept}, and why is it important?",
                     f"Explain {concept} to a high school student.", f"Describe {concept} and give an everyday example.",
                     f"What are the main misconceptions about {concept} in {field}?"])


def _humanities(r: random.Random) -> str:
    t = r.choice(HUMANITIES)
    return r.choice([f"Provide insights into {t}.", f"Discuss {t}. Give concrete examples.",
                     f"Explain {t} in a few paragraphs.", f"What can we learn today from {t}?",
                     f"Write a short lecture outline about {t}."])


GERMAN_SUBJECTS = ["Die Regierung", "Der Bürgermeister", "Die Polizei", "Viele Menschen", "Das Unternehmen",
                   "Die Schüler", "Meine Schwester", "Der Präsident", "Die Forscher", "Die Stadt", "Der Verein",
                   "Die Bank", "Unsere Nachbarn", "Der Trainer", "Die Ärzte", "Die Firma"]
GERMAN_PREDICATES = ["hat am Montag einen neuen Plan vorgestellt", "will die Steuern senken", "hat die Preise erhöht",
                     "sucht dringend neue Mitarbeiter", "plant ein großes Fest im Sommer", "hat das Spiel knapp verloren",
                     "warnt vor starkem Regen", "baut eine neue Schule", "hat die Ergebnisse der Studie veröffentlicht",
                     "fordert mehr Geld für die Bildung", "ist mit der Entscheidung nicht zufrieden",
                     "hat einen Rekord aufgestellt", "eröffnet nächste Woche ein Museum", "reist im Herbst nach Spanien",
                     "hat den Vertrag um zwei Jahre verlängert", "muss wegen der Krise sparen"]
GERMAN_ADVERBIALS = ["", "", " in Berlin", " trotz der Krise", " nach langen Verhandlungen", " am Wochenende",
                     " in diesem Jahr", " zum ersten Mal", " wegen des schlechten Wetters", " in der Innenstadt"]
FRENCH = ["Le gouvernement a annoncé de nouvelles mesures pour les écoles.", "Les prix de l'énergie ont augmenté "
          "cet hiver.", "La ville va construire un nouveau pont sur la rivière.", "Les chercheurs ont découvert une "
          "nouvelle espèce de poisson.", "Le musée sera fermé pendant les vacances."]


def _translation(r: random.Random) -> str:
    if r.random() < 0.15:
        return f"Translate French to English: {r.choice(FRENCH)}"
    sents = []
    for _ in range(r.choice([1, 1, 1, 2])):
        sents.append(f"{r.choice(GERMAN_SUBJECTS)} {r.choice(GERMAN_PREDICATES)}{r.choice(GERMAN_ADVERBIALS)}.")
    text = " ".join(sents)
    if r.random() < 0.3:  # the WMT style of the benchmark: spaces before punctuation
        text = text.replace(",", " ,").replace(".", " .").rstrip(" .")
    return f"Translate German to English: {text}"


QA = [
    "What is the capital of {country}?", "Who wrote {book}?", "When was {thing} invented?",
    "How many {unit_small} are in a {unit_big}?", "Who played the lead role in {show}?",
    "What is the largest {kind} in the world?", "Where is {landmark} located?", "What does {abbr} stand for?",
    "Who was the first person to {feat}?", "Why is the sky blue?", "What language is spoken in {country}?",
    "How long does it take light from the Sun to reach Earth?", "What is the boiling point of water in Fahrenheit?",
]
QA_FILL = {
    "country": ["France", "Japan", "Brazil", "Kenya", "Canada", "Australia", "Norway", "Egypt", "India", "Mexico"],
    "book": ["Pride and Prejudice", "The Old Man and the Sea", "War and Peace", "Don Quixote", "Hamlet", "Moby-Dick"],
    "thing": ["the telephone", "the light bulb", "the airplane", "the internet", "the steam engine", "paper"],
    "unit_small": ["centimeters", "ounces", "seconds", "days", "feet"],
    "unit_big": ["meter", "pound", "hour", "year", "mile"],
    "show": ["a popular fantasy TV series", "the first Star Wars film", "Titanic", "The Lion King musical"],
    "kind": ["ocean", "desert", "country by area", "animal", "planet in the solar system", "lake"],
    "landmark": ["the Eiffel Tower", "Machu Picchu", "the Great Barrier Reef", "Mount Kilimanjaro", "the Colosseum"],
    "abbr": ["NASA", "DNA", "UNESCO", "CPU", "GDP", "HTML"],
    "feat": ["walk on the Moon", "climb Mount Everest", "fly across the Atlantic alone", "reach the South Pole"],
}


def _qa(r: random.Random) -> str:
    form = r.choice(QA)
    for key, values in QA_FILL.items():
        form = form.replace("{" + key + "}", r.choice(values))
    if r.random() < 0.5:
        form = form[0].lower() + form[1:]  # the benchmark's questions are often lower case
    return form


def _news_passage(r: random.Random, sentences: int) -> str:
    """A news-like report from templates with random names, places and numbers."""
    place, org = r.choice(PLACES), r.choice(ORGS)
    a, b = r.sample(NAMES, 2)
    n, m, year = r.randint(3, 90), r.randint(100, 9000), r.randint(1995, 2024)
    topic = r.choice(TOPICS)
    pool = [
        f"Officials in {place} announced on {r.choice(['Monday', 'Tuesday', 'Friday'])} that {org} will start a new "
        f"programme about {topic}.",
        f"The plan, which will cost about {m} thousand dollars, was approved after months of debate.",
        f"{a}, a spokesperson for {org}, said the project would help at least {m} residents.",
        f"Critics, including local business owner {b}, argued that the money should be spent on roads and schools.",
        f"According to a survey published in {year}, {n} percent of residents support the idea.",
        f"The first phase is expected to be completed within {r.randint(2, 24)} months.",
        "Similar projects in other cities have had mixed results, with some reporting higher costs than expected.",
        f"{b} told reporters that the town had been waiting for a decision like this for years.",
        f"Volunteers will hold information meetings every {r.choice(['week', 'month'])} at the town hall.",
        f"The announcement comes after a difficult year in which {org} lost {n} employees.",
        f"Experts say that {topic} will become more important in the coming decade.",
        f"{a} added that the results will be reviewed by an independent committee in {year + 2}.",
        "Some residents worry about noise and traffic during the construction period.",
        f"Local newspapers reported that the mayor of {place} will visit the site next month.",
        f"In a statement, {org} thanked the community for its patience and support.",
    ]
    r.shuffle(pool)
    return " ".join(pool[:sentences])


_DOC_MODULES = ["json", "os", "re", "collections", "argparse", "logging", "unittest", "pathlib", "subprocess",
                "threading", "datetime", "decimal", "fractions", "statistics", "random", "textwrap", "string",
                "itertools", "functools", "heapq", "bisect", "csv", "sqlite3", "zipfile", "tarfile", "shutil",
                "tempfile", "glob", "fnmatch", "pickle", "copy", "pprint", "enum", "dataclasses", "typing",
                "contextlib", "inspect", "ast", "difflib", "hashlib", "secrets", "uuid", "urllib.parse", "socket",
                "queue", "sched", "calendar", "locale", "codecs", "struct", "weakref", "traceback", "warnings",
                "doctest", "timeit", "email.message", "http.client", "html", "xml.dom.minidom", "math", "cmath",
                "operator", "shlex", "getopt", "configparser", "base64", "binascii", "gzip", "bz2", "io"]
_DOCS: list | None = None


def _local_docs() -> list:
    """[(name, text)] docstrings of stdlib modules/functions/classes and pydoc help topics."""
    global _DOCS
    if _DOCS is None:
        docs = []
        with warnings.catch_warnings():  # deprecated names (e.g. in typing) warn when looked up
            warnings.simplefilter("ignore")
            _collect_docs(docs)
        _DOCS = docs
    return _DOCS


def _collect_docs(docs: list) -> None:
    for mod_name in _DOC_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # a module missing from this build of Python
            continue
        if mod.__doc__ and len(mod.__doc__) > 200:
            docs.append((mod_name, mod.__doc__.strip()))
        for attr in sorted(dir(mod)):
            obj = getattr(mod, attr, None)
            doc = getattr(obj, "__doc__", None)
            if attr.startswith("_") or not callable(obj) or not isinstance(doc, str) or len(doc) < 150:
                continue
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            docs.append((f"{mod_name}.{attr}", doc.strip()))
    try:
        from pydoc_data.topics import topics

        docs += [(k, v.strip()) for k, v in sorted(topics.items()) if len(v) > 300]
    except ImportError:
        pass


def _doc_passage(r: random.Random, max_chars: int) -> str:
    docs = _local_docs()
    name, text = r.choice(docs)
    text = re.sub(r"\n{3,}", "\n\n", text)
    if len(text) > max_chars:
        start = r.randrange(0, len(text) - max_chars + 1)
        start = text.rfind("\n", 0, start) + 1
        text = text[start: start + max_chars]
        text = text[: text.rfind(".") + 1] or text
    return text


def _docstring_function(r: random.Random) -> str | None:
    docs = [(n, t) for n, t in _local_docs() if "." in n and len(t) < 900]
    if not docs:
        return None
    name, text = r.choice(docs)
    fn = name.split(".")[-1]
    body = "\n".join("    " + line for line in ('"""' + text + '"""').splitlines())
    return f"def {fn}(*args, **kwargs):\n{body}\n    ..."


def _passage(r: random.Random, long: bool) -> str:
    if r.random() < 0.5:
        return _news_passage(r, r.randint(8, 15) if long else r.randint(4, 7))
    return _doc_passage(r, r.choice([2500, 3500]) if long else r.choice([700, 1200]))


def _summarization(r: random.Random) -> str:
    p = _passage(r, long=r.random() < 0.5)
    return r.choice([f"Summarize: {p}", f"Summarize the following text in a few sentences:\n\n{p}",
                     f"Summarize: {p}", f"Write a short summary of this text: {p}"])


def _rag(r: random.Random) -> str:
    p = _passage(r, long=r.random() < 0.5)
    q = r.choice(["What is the main point of the text?", "Describe the key facts mentioned above.",
                  "According to the passage, what are the most important details?",
                  "Answer from the passage: what problem is being described and how is it addressed?",
                  "What does the text say about how this works?", "List the main ideas of the passage."])
    return f"{p}\n{q}"


def _extraction(r: random.Random) -> str:
    if r.random() < 0.4:
        reviews = []
        for i in range(r.randint(2, 4)):
            mood = r.choice(["was phenomenal, everything was top-notch", "was a complete disappointment",
                             "was fine, nothing special", "had great acting but a weak plot",
                             "was boring and far too long", "surprised me in the best way"])
            reviews.append(f"{i + 1}. This {r.choice(['movie', 'restaurant', 'phone', 'hotel'])}, reviewed in "
                           f"{r.randint(2015, 2024)}, {mood}.")
        return ("Evaluate the following reviews on a scale of 1 to 5, with 1 being very negative and 5 very "
                "positive:\n" + "\n".join(reviews) + "\nReturn the answer as a JSON array of integers.")
    p = _news_passage(r, r.randint(4, 7))
    what = r.choice(["the names of all people", "all numbers and what they refer to", "the organisations and places",
                     "every date or year"])
    fmt = r.choice(["as a JSON object", "as a bulleted list", "in a table", "as CSV"])
    return f"Extract {what} mentioned in the following text and return them {fmt}.\n\n{p}"


def _writing(r: random.Random) -> str:
    return r.choice(WRITING_FORMS).format(t=r.choice(TOPICS))


def _roleplay(r: random.Random) -> str:
    q = r.choice(ROLE_QUESTIONS).format(t=r.choice(TOPICS))
    return r.choice(ROLE_FORMS).format(p=r.choice(PERSONAS), q=q)


MAKERS = {"writing": _writing, "roleplay": _roleplay, "reasoning": _reasoning, "math": _math, "coding": _coding,
          "extraction": _extraction, "stem": _stem, "humanities": _humanities, "translation": _translation,
          "summarization": _summarization, "qa": _qa, "math_reasoning": _math_reasoning, "rag": _rag}


def synthetic_prompts(n: int, seed: int = 0, categories=CATEGORIES) -> list[dict]:
    """``n`` distinct prompts [{"category", "prompt"}], round-robin over ``categories``."""
    r = random.Random(seed)
    out, seen = [], set()
    attempts = 0
    while len(out) < n and attempts < 50 * n:
        cat = categories[attempts % len(categories)]
        attempts += 1
        text = MAKERS[cat](r)
        if text in seen:
            continue
        seen.add(text)
        out.append({"category": cat, "prompt": text})
    return out
