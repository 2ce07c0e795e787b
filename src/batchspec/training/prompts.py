"""The generated training prompt sets of ``batchspec train-draft``: templates and word lists written for this purpose,
expanded with a seed.

``training_prompts`` (the first set) covers the same kinds of request as the 13 Spec-Bench categories;
``broad_prompts`` (the second) puts any topic under any kind of request, with the target's earlier answers as the
texts to summarise or answer from. Neither holds any of the built-in evaluation prompts
(``batchspec/data/prompts.jsonl``): both drop a prompt that shares an 8-word sequence with one of those, and
``check_held_out`` (run by the gen stage) asserts there is no overlap left.
"""

from __future__ import annotations

import random
import re

NAMES = ["Alice", "Omar", "Priya", "Lukas", "Mei", "Jonas", "Fatima", "Diego", "Hana", "Kwame", "Sofia", "Ivan",
         "Leila", "Marco", "Yuki", "Nadia", "Pedro", "Elena", "Samir", "Grace", "Tariq", "Chloe", "Ravi", "Zara"]
CITIES = ["Oslo", "Nairobi", "Lyon", "Osaka", "Quito", "Krakow", "Adelaide", "Cairo", "Denver", "Hanoi", "Bergen",
          "Seville", "Tampere", "Accra", "Leeds", "Graz", "Medellin", "Pune", "Halifax", "Dundee"]
ITEMS = ["notebook", "umbrella", "bread roll", "tea", "sandwich", "lamp", "cable", "mug", "pen", "scarf", "soap",
         "candle", "apple", "salad", "phone case", "battery", "towel", "cookie"]
LANGS = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
CODE_LANGS = ["Python", "JavaScript", "Java", "C", "Go", "Rust", "C++", "TypeScript"]

WRITING = [
    ("Write a short story about {x}.", [
        "a cat who learns to open doors", "a boy who finds a map in his grandmother's attic", "a baker who wakes up "
        "with no memory", "two strangers stuck in a lift", "a dragon afraid of fire", "a girl who can talk to trees",
        "an old fisherman and a talking seagull", "a detective solving a mystery at a train station", "a robot "
        "gardener", "a lost dog finding its way home", "a time traveller visiting a medieval market", "a shy "
        "musician's first concert", "a village where it never stops raining", "a postman who reads every letter",
        "a family moving to a farm", "an astronaut alone on the moon"]),
    ("Write a poem about {x}.", [
        "autumn leaves", "the ocean at night", "a busy city morning", "friendship", "a rainy afternoon", "the desert",
        "an old oak tree", "a summer storm", "the moon", "coffee", "a train journey", "a garden in spring", "stars",
        "a mountain lake", "memories of childhood", "a lighthouse"]),
    ("Write a blog post about {x}.", [
        "the benefits of walking every day", "how to start journaling", "learning to cook on a budget", "travelling "
        "by train across Europe", "keeping houseplants alive", "working from home productively", "reducing food "
        "waste", "why reading fiction matters", "beginner photography tips", "saving money on groceries", "the "
        "history of board games", "staying focused while studying", "making your own bread", "minimalist living"]),
    ("Write a formal email to {x}.", [
        "a landlord about a broken heater", "a teacher asking for an extension on an essay", "a hotel to confirm a "
        "booking", "a manager requesting a day off", "a customer apologising for a late delivery", "a city council "
        "about a damaged pavement", "a supplier asking for a price list", "a colleague to schedule a project "
        "meeting", "a university admissions office about application deadlines", "a gym to cancel a membership"]),
    ("Write a product description for {x}.", [
        "a waterproof hiking backpack", "a smart thermostat", "noise-cancelling headphones", "an electric kettle",
        "a foldable bicycle", "a handmade ceramic mug", "a children's picture book about space", "a standing desk",
        "organic green tea", "a solar-powered phone charger", "a wool winter coat", "a mechanical keyboard"]),
    ("Write a short speech for {x}.", [
        "a friend's wedding", "a school graduation", "the opening of a new library", "a retirement party", "a "
        "sports team after losing a final", "a charity fundraiser", "the first day of a new job", "a birthday dinner"]),
    ("Write a review of {x}.", [
        "a small family-run pizza restaurant", "a science fiction film about first contact", "a pair of running "
        "shoes", "a fantasy novel for teenagers", "a budget hotel near a train station", "a cooking class", "a "
        "mobile game about farming", "a live jazz concert", "a museum of natural history", "an electric scooter"]),
    ("Write a recipe for {x}.", [
        "vegetable soup", "banana bread", "a simple tomato pasta", "pancakes", "a fruit salad", "lentil curry",
        "chocolate chip cookies", "a green smoothie", "roasted potatoes", "a vegetable stir-fry"]),
    ("Write a diary entry from the point of view of {x}.", [
        "a student on the first day at a new school", "a sailor crossing the Atlantic", "a dog waiting for its "
        "owner", "an explorer in the jungle", "a nurse after a night shift", "a child visiting the sea for the "
        "first time", "a farmer during a dry summer", "a young chef opening a restaurant"]),
    ("Write a short dialogue between {x}.", [
        "a customer and a shop assistant about a refund", "two friends planning a camping trip", "a doctor and a "
        "patient with a cold", "a teacher and a student who forgot homework", "a tourist asking for directions and "
        "a local", "two robots discussing the weather", "a parent and a teenager about screen time"]),
    ("Write an invitation to {x}.", [
        "a birthday picnic in the park", "a neighbourhood clean-up day", "a book club meeting", "a charity run",
        "a housewarming party", "a school science fair", "a board game evening"]),
    ("Write a persuasive paragraph arguing that {x}.", [
        "cities should plant more trees", "schools should teach cooking", "people should read more books",
        "public transport should be free", "everyone should learn a second language", "homework should be limited",
        "companies should allow flexible hours", "music lessons are valuable for children"]),
]

ROLEPLAY = [
    ("Pretend you are {x}.", [
        "a pirate captain describing your ship to a new crew member", "a medieval knight preparing for a "
        "tournament", "a weather forecaster presenting tomorrow's forecast", "a detective interviewing a witness",
        "a space station commander giving a morning briefing", "a wise old wizard advising a young apprentice",
        "a sports commentator describing the final minute of a football match", "a travel agent selling a holiday "
        "to Iceland", "a zookeeper introducing the penguins", "a librarian helping someone find a book", "a "
        "personal trainer starting a first session", "a tour guide in ancient Rome", "a flight attendant making "
        "the safety announcement", "a scientist announcing a new discovery", "a shopkeeper in a magic shop",
        "a ship's cook complaining about supplies", "a park ranger warning hikers about bears", "a king addressing "
        "his people after a long war", "a mountain guide at the summit", "a barista describing today's specials"]),
    ("Act as {x}.", [
        "a job interviewer and ask me three questions for a marketing role", "a language tutor and teach me five "
        "words in Italian", "a career coach and help me plan my next step", "a tech support agent and help me fix "
        "slow Wi-Fi", "a fitness coach and design a ten-minute workout", "a chess teacher explaining the opening "
        "principles", "a cooking instructor teaching how to boil pasta", "a travel guide recommending things to "
        "do in Kyoto", "a museum curator describing a famous painting", "a friendly alien visiting Earth for the "
        "first time", "a gardener explaining how to plant bulbs", "a news reporter covering a local festival",
        "a hotel receptionist checking in a guest", "a driving instructor on the first lesson"]),
    ("You are {x}. Introduce yourself and describe a typical day.", [
        "a beekeeper", "an air traffic controller", "a deep-sea diver", "a baker in Paris", "a mountain rescue "
        "volunteer", "a violin maker", "a train driver", "a marine biologist", "a bookshop owner", "a farmer "
        "raising sheep", "a firefighter", "a video game designer"]),
]

STEM = [
    ("Explain {x} in simple terms.", [
        "how photosynthesis works", "why the sky is blue", "what black holes are", "how the heart pumps blood",
        "how earthquakes happen", "what DNA does", "how a rainbow forms", "how magnets work", "what gravity is",
        "how batteries store energy", "how the internet sends data", "why we have seasons", "how airplanes fly",
        "what causes tides", "how antibiotics work", "what an atom is made of", "how a refrigerator keeps food "
        "cold", "what climate change is", "how volcanoes erupt", "how the human eye sees colour", "what "
        "electricity is", "how plants absorb water", "what a neural network is", "how sound travels", "why "
        "metals conduct heat", "how a microwave oven heats food", "what the greenhouse effect is", "how the "
        "kidneys filter blood", "what evolution by natural selection means", "how a compass works",
        "what a light year is", "how bridges carry heavy loads", "how wind turbines make electricity", "what "
        "happens during digestion", "how clouds form", "what enzymes do", "how GPS finds your position", "what a "
        "chemical reaction is", "how bees make honey", "how the moon affects the oceans", "what stem cells are",
        "how lenses bend light", "how a car engine works", "what an electric circuit is", "how glaciers move"]),
    ("What is the difference between {x}?", [
        "a virus and a bacterium", "weather and climate", "mass and weight", "an acid and a base", "AC and DC "
        "current", "RAM and storage", "a comet and an asteroid", "mitosis and meiosis", "heat and temperature",
        "a conductor and an insulator", "a planet and a star", "renewable and non-renewable energy",
        "power and energy", "an element and a compound", "a herbivore and a carnivore", "a solid and a liquid",
        "voltage and current", "a cell wall and a cell membrane", "an earthquake and a tsunami", "hardware and "
        "software"]),
]

HUMANITIES = [
    ("What were the main causes and effects of {x}?", [
        "the French Revolution", "the Industrial Revolution", "the First World War", "the fall of the Berlin Wall",
        "the Great Depression", "the American Civil War", "the Renaissance", "the collapse of the Mayan cities",
        "the Protestant Reformation", "the end of the Cold War"]),
    ("Explain the main ideas of {x}.", [
        "Plato's theory of forms", "utilitarianism", "existentialism", "Confucian ethics", "stoicism", "the "
        "Enlightenment", "Kant's categorical imperative", "impressionist painting", "Romanticism in literature",
        "Aristotle's view of virtue", "Buddhist philosophy", "liberal democracy", "the scientific revolution",
        "Marx's theory of class", "the philosophy of Descartes", "the Harlem Renaissance", "Baroque music",
        "Greek mythology", "the separation of powers"]),
    ("Describe the life and achievements of {x}.", [
        "Marie Curie", "Leonardo da Vinci", "Nelson Mandela", "Galileo Galilei", "Ada Lovelace", "Mahatma Gandhi",
        "Cleopatra", "Isaac Newton", "Frida Kahlo", "Charles Darwin", "Wolfgang Amadeus Mozart", "Queen Victoria"]),
    ("Why is {x} considered important in history?", [
        "the Magna Carta", "the Silk Road", "the invention of writing", "the voyages of Magellan", "the "
        "construction of the pyramids", "the Meiji Restoration", "the abolition of slavery", "the discovery of "
        "penicillin", "the moon landing", "the Olympic Games"]),
]

QA = [
    "What is the largest planet in our solar system?", "Who painted the Mona Lisa?", "What is the chemical symbol "
    "for gold?", "How many continents are there?", "What is the longest river in Africa?", "Who developed the theory "
    "of relativity?", "What language is spoken in Brazil?", "What is the capital of Canada?", "How many legs does a "
    "spider have?", "What is the tallest mountain in the world?", "Who wrote Romeo and Juliet?",
    "What gas do plants absorb from the air?", "What is the smallest prime "
    "number?", "Which ocean is the largest?", "What is the capital of Japan?", "Who invented the telephone?", "How "
    "many days are in a leap year?", "What is the hardest natural material?", "Which planet is known as the red "
    "planet?", "What is the main ingredient of guacamole?", "In which country are the pyramids of Giza?", "What is "
    "the speed of light approximately?", "Who was the first person to walk on the moon?", "What is the currency of "
    "the United Kingdom?", "How many players are on a football team?", "What is the capital of Kenya?", "Which "
    "organ produces insulin?", "What does a thermometer measure?", "What is the largest mammal?", "Who composed the "
    "Four Seasons?", "What is the capital of Argentina?", "How many hours are in a week?", "What is the square root "
    "of 144?", "Which element has the atomic number 1?", "What is the largest desert in the world?", "Who wrote "
    "The Odyssey?", "What is the capital of Egypt?", "How many strings does a violin have?", "What is the national "
    "animal of Scotland?", "What is the capital of Norway?", "Who discovered gravity when an apple fell?",
    "Which metal is liquid at room temperature?", "How many minutes are in a day?", "What is the largest country by "
    "area?", "Who is the author of Don Quixote?", "What is the primary language of Mexico?", "What do bees make?",
    "What is the capital of Italy?", "How many sides does a hexagon have?", "Who painted The Starry Night?", "What "
    "is the largest organ of the human body?", "Which planet has the most moons?", "What is the chemical formula of "
    "water?", "Who wrote Hamlet?", "What is the capital of Spain?", "How many centimetres are in a metre?", "What "
    "is the longest bone in the human body?", "Which country has the largest population?", "What is the main gas in "
    "the Earth's atmosphere?", "Who invented the light bulb?", "What is the capital of Germany?", "How many weeks "
    "are in a year?", "What is the fastest land animal?", "Which instrument has black and white keys?", "What is the "
    "capital of Peru?", "Who was Albert Einstein?", "What is the coldest continent?", "What do caterpillars turn "
    "into?", "What is the capital of Sweden?", "Which sea is the saltiest?", "What year did the Second World War "
    "end?", "What is the largest island in the world?", "Who discovered penicillin?", "What is the capital of "
    "India?", "What colour do you get by mixing blue and yellow?", "How many planets are in the solar system?",
]

SENTENCES = [
    "The weather is very nice today.", "I would like to order a cup of coffee, please.", "Where is the museum?",
    "My brother plays the guitar every evening.", "We are going to the beach this weekend.", "The train is late "
    "again.", "Can you help me carry these boxes?", "She reads a new book every week.", "The children are playing "
    "in the garden.", "I forgot my keys at home.", "This restaurant serves the best soup in town.", "How much does "
    "this jacket cost?", "Our meeting starts at three o'clock.", "He has lived in this city for ten years.", "Please "
    "close the window, it is cold.", "The shop on the corner sells fresh bread.", "I am learning to swim.", "They "
    "visited their grandparents last summer.", "The cat is sleeping on the sofa.", "Do you know a good doctor?",
    "We need more milk and eggs.", "The concert was wonderful.", "It takes twenty minutes to walk to school.",
    "I have a headache and I need to rest.", "The film starts in half an hour.", "We should leave before it "
    "starts to rain.", "The museum is closed on Mondays.", "My favourite season is autumn.", "Could you speak more "
    "slowly, please?", "The bus stop is next to the bakery.", "I will call you tomorrow morning.", "Their house has "
    "a big garden.", "He works in a bank in the city centre.", "The soup is too hot to eat.", "I need a ticket to "
    "the airport.",
]
FOREIGN = [
    "Je voudrais une chambre pour deux nuits.", "El perro duerme debajo de la mesa.", "Ich habe heute keine Zeit.",
    "La cena estara lista a las ocho.", "Nous avons visite le chateau hier.", "Wo ist die nachste Apotheke?",
    "Mi hermano vive en Madrid desde hace tres anos.", "Il pleut depuis ce matin.", "Das Wetter ist heute "
    "schoen.", "Me gusta leer antes de dormir.", "Elle travaille dans une ecole primaire.", "Wir fahren am "
    "Wochenende in die Berge.",
]

EXPLAIN_TASKS = [
    "Give me five tips for {x}.", "What are the pros and cons of {x}?", "How do I get started with {x}?",
    "Describe a simple plan for {x}."]
ACTIVITIES = ["learning to play the piano", "running a first marathon", "improving sleep", "public speaking",
              "learning to code", "keeping a small garden", "saving for a holiday", "studying for exams",
              "living in a big city", "electric cars", "remote work", "online learning", "owning a dog",
              "cycling to work", "learning to draw", "meal planning", "moving abroad", "volunteering"]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the factorial of n", "computes the n-th "
    "Fibonacci number", "counts the vowels in a string", "finds the largest number in a list", "sorts a list of "
    "words by length", "merges two sorted lists", "converts Celsius to Fahrenheit", "checks if two strings are "
    "anagrams", "removes all whitespace from a string", "returns the sum of the digits of a number", "flattens a "
    "nested list", "counts how often each word appears in a text", "finds the second smallest element of a list",
    "checks whether a year is a leap year", "computes the greatest common divisor of two numbers", "implements "
    "binary search", "capitalises the first letter of every word", "returns the average of a list of numbers",
    "generates all even numbers below n", "validates a simple email address", "rotates a list by k positions",
    "transposes a matrix"]
SNIPPETS = [
    "def add(a, b):\n    return a - b", "for i in range(10):\n    if i % 2 == 0:\n        print(i)",
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)", "def avg(nums):\n    return sum(nums) / len(nums)",
    "function square(n) { return n * n; }\nconsole.log([1, 2, 3].map(square));",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 3;",
    "while True:\n    line = input()\n    if line == 'quit':\n        break", "s = 'hello'\nprint(s[::-1].upper())",
    "def fact(n):\n    if n == 0:\n        return 1\n    return n * fact(n - 1)",
    "d = {'a': 1, 'b': 2}\nfor k, v in d.items():\n    print(k, v)",
]
SNIPPET_ASKS = ["What does this code do?\n{x}", "Is there a bug in this code? Explain.\n{x}",
                "Rewrite this code in a clearer way and explain your changes:\n{x}", "Add comments to this code:\n{x}"]
CODE_EXPLAIN = [
    "recursion", "a hash map", "object-oriented programming", "a linked list", "big-O notation", "a REST API",
    "version control with git", "unit testing", "a stack and a queue", "exceptions and error handling",
    "list comprehensions in Python", "asynchronous programming", "SQL joins", "a binary tree", "garbage collection"]

PASSAGES = [
    "Sea otters spend most of their lives in the water. They use rocks as tools to open shellfish, often resting "
    "the rock on their chest while floating on their backs. Otters have the densest fur of any animal, which keeps "
    "them warm because they lack a thick layer of fat. Groups of otters sometimes hold paws while sleeping so they "
    "do not drift apart.",
    "The school introduced a four-day week for older students last year. Attendance improved, and teachers reported "
    "that students seemed more rested. However, some parents found it difficult to arrange childcare on the fifth "
    "day. The school board will review exam results in June before deciding whether to continue.",
    "Coffee was first cultivated in the region that is now Ethiopia and Yemen. By the fifteenth century it was "
    "popular in the Middle East, and coffee houses became places for conversation, music and news. The drink "
    "reached Europe in the seventeenth century, where coffee houses played a similar social role.",
    "The new electric bus line connects the airport with the city centre every fifteen minutes. Each bus carries up "
    "to eighty passengers and is charged overnight at a depot outside the city. Officials expect the line to cut "
    "air pollution along the route and to reduce journey times by ten minutes.",
    "Volunteers at the river clean-up collected more than two tonnes of rubbish in a single day. Most of it was "
    "plastic bottles and bags, but they also found a shopping trolley and an old bicycle. The organisers plan to "
    "repeat the event every spring and hope to attract more schools next year.",
    "Octopuses are known for their intelligence. They can solve puzzles, open jars and escape from tanks. Each of "
    "their eight arms contains many neurons, allowing the arms to react to touch and taste on their own. Most "
    "octopuses live only one or two years.",
    "A local bakery has started delivering bread by bicycle. The owner says the idea came from customers who "
    "wanted fresh bread early in the morning. Deliveries start at six, cover a radius of five kilometres and cost "
    "one euro extra. The bakery now employs three riders.",
    "The annual book fair attracted over ten thousand visitors this year. More than two hundred publishers showed "
    "new titles, and several authors gave readings and signed books. Children's books were the most popular, "
    "followed by crime novels and cookbooks.",
    "Researchers tested a new type of concrete that absorbs carbon dioxide while it hardens. In early trials the "
    "material was as strong as ordinary concrete. The team now wants to test it in a small bridge to see how it "
    "behaves over several years of weather.",
    "The mountain village has only one shop, which also works as a post office and a cafe. In winter the road is "
    "often closed by snow, so residents store food for several weeks. Tourists visit in summer to hike the old "
    "shepherd trails and to see the wild flowers.",
]
SUMMARY_ASKS = ["Summarize this text in one sentence: \"{x}\"", "Give a short summary of the following: \"{x}\"",
                "What are the two most important points of this passage? \"{x}\"",
                "Summarize the following in three bullet points: \"{x}\""]
PASSAGE_QUESTIONS = ["What is the passage mainly about?", "What problem or concern is mentioned?",
                     "List two facts given in the passage.", "What happens next, according to the passage?"]

PRODUCTS = ["tablet", "coffee machine", "e-bike", "camera", "smartwatch", "vacuum cleaner", "tent", "speaker"]


def _ordering(rng):
    people = rng.sample(NAMES, 4)
    attr = rng.choice([("older", "oldest", "youngest"), ("faster", "fastest", "slowest"),
                       ("heavier", "heaviest", "lightest")])
    facts = [f"{people[i]} is {attr[0]} than {people[i + 1]}" for i in range(3)]
    rng.shuffle(facts)
    ask = rng.choice([attr[1], attr[2]])
    return f"{'. '.join(facts)}. Who is the {ask}? Explain your answer."


def _syllogism(rng):
    words = ["florps", "mibbles", "tarks", "zonks", "grebs", "quills", "dranes", "plims", "wugs", "snerks"]
    a, b, c = rng.sample(words, 3)
    form = rng.choice([
        f"All {a} are {b}, and all {b} are {c}. Are all {a} {c}? Explain.",
        f"No {a} are {b}, and some {c} are {a}. Can we say that some {c} are not {b}? Explain.",
        f"Some {a} are {b}, and all {b} are {c}. Must some {a} be {c}? Explain.",
    ])
    return form


def _riddle(rng):
    n = rng.randint(3, 9)
    return rng.choice([
        f"If it takes {n} machines {n} minutes to make {n} widgets, how long would it take {n * 10} machines to make "
        f"{n * 10} widgets? Explain.",
        f"A clock shows {rng.randint(1, 11)}:{rng.choice(['15', '30', '45'])}. What is the angle between the hour "
        "and minute hands? Explain your reasoning.",
        f"I have {n} brothers and each brother has one sister. How many children are in the family? Explain.",
        f"A snail climbs {n} metres up a wall during the day and slides down {n - 1} metres at night. The wall is "
        f"{n * 3} metres high. On which day does it reach the top?",
    ])


def _math(rng):
    a, b, c = rng.randint(12, 99), rng.randint(3, 60), rng.randint(2, 40)
    return rng.choice([
        f"What is {a} multiplied by {b}?", f"Calculate {a * b} divided by {b}.", f"What is {a} + {b} * {c}?",
        f"Solve for x: {c}x + {a} = {c * b + a}.", f"What is {b}% of {a * 10}?",
        f"Find the area of a triangle with base {a} and height {b}.", f"What is the square of {a}?",
        f"Simplify the fraction {a * c}/{b * c}.", f"What is the perimeter of a square with side {b} cm?",
        f"Convert {a} kilometres into metres.", f"Find the mean of {a}, {b} and {c}.",
        f"What is the sum of the first {b} positive even numbers?", f"Solve: {a} - {b} + {c} = ?",
        f"If f(x) = {c}x + {b}, what is f({rng.randint(2, 9)})?",
    ])


def _math_reasoning(rng):
    n1, n2 = rng.sample(NAMES, 2)
    a, b, c = rng.randint(3, 20), rng.randint(2, 9), rng.randint(10, 50)
    item = rng.choice(ITEMS)
    return rng.choice([
        f"{n1} buys {a} {item}s for {b} dollars each and pays with a {c * 10} dollar bill. How much change does "
        f"{n1} get?",
        f"{n1} reads {a} pages a day. How many days does it take to finish a book of {a * c} pages?",
        f"A car travels at {c + 30} km per hour for {b} hours. How far does it go?",
        f"{n1} has {a} more stickers than {n2}. Together they have {2 * c + a} stickers. How many does each have?",
        f"A recipe needs {b} eggs for {a} people. How many eggs are needed for {a * 3} people?",
        f"A shop gives a {rng.choice([10, 20, 25, 50])}% discount on a {item} that costs {c * 2} dollars. What is "
        "the new price?",
        f"{n1} saves {b} dollars every week. How many weeks until {n1} has {b * c} dollars?",
        f"A tank holds {c * 10} litres and fills at {b * 5} litres per minute. How long does it take to fill it?",
    ])


def _extraction(rng):
    ppl = rng.sample(NAMES, 3)
    cities = rng.sample(CITIES, 3)
    day = rng.randint(1, 28)
    month = rng.choice(["January", "April", "June", "September", "November"])
    text = (f"{ppl[0]} flew from {cities[0]} to {cities[1]} on {day} {month} to meet {ppl[1]}, and {ppl[2]} joined "
            f"them two days later from {cities[2]}.")
    prices = ", ".join(f"{rng.randint(1, 4)}x {it} {rng.randint(1, 20)}.{rng.choice(['00', '50', '99'])}"
                       for it in rng.sample(ITEMS, 3))
    return rng.choice([
        f"List every person and every city mentioned in this text: \"{text}\"",
        f"Extract the date and the travellers from this sentence: \"{text}\"",
        f"Return the items and prices in this order as JSON: \"{prices}\"",
        f"Which cities appear in the following text, and who is connected to each? \"{text}\"",
        f"Extract the email addresses from this note: \"Contact {ppl[0].lower()}@example.org for tickets or "
        f"{ppl[1].lower()}.{ppl[2].lower()}@example.com for press questions.\"",
    ])


def _rag(rng):
    name = rng.choice(["Aurora", "Vega", "Nimbus", "Kestrel", "Atlas", "Juniper", "Solace", "Corvid"])
    prod = rng.choice(PRODUCTS)
    w, h, p = rng.randint(1, 9), rng.randint(4, 30), rng.randint(49, 999)
    colour = rng.sample(["black", "silver", "green", "blue", "red", "white"], 2)
    ctx = (f"The {name} {prod} costs {p} dollars. It weighs {w} kg, runs for {h} hours on one charge and comes in "
           f"{colour[0]} and {colour[1]}. The warranty lasts {rng.randint(1, 5)} years.")
    q = rng.choice(["How much does it cost and what colours are available?", "How long does it run on one "
                    "charge?", "How heavy is it and how long is the warranty?", "Which colours can I choose?"])
    town = rng.choice(CITIES)
    ctx2 = (f"The {town} city museum opens at {rng.randint(8, 11)} am and closes at {rng.randint(4, 8)} pm. Entry "
            f"costs {rng.randint(5, 20)} dollars for adults and is free for children under {rng.randint(6, 14)}. "
            f"Guided tours start every {rng.choice(['hour', 'two hours', 'thirty minutes'])}.")
    q2 = rng.choice(["When does the museum open and close?", "How much does entry cost for a family?", "How often "
                     "do guided tours start?", "Is entry free for children?"])
    return rng.choice([f"Use the context to answer the question.\nContext: \"{ctx}\"\nQuestion: {q}",
                       f"Answer using only the text below.\nText: \"{ctx2}\"\nQuestion: {q2}"])


def _filled(rng, table):
    template, fillers = rng.choice(table)
    return template.format(x=rng.choice(fillers))


def _generators():
    return {
        "writing": lambda r: _filled(r, WRITING),
        "roleplay": lambda r: _filled(r, ROLEPLAY),
        "reasoning": lambda r: r.choice([_ordering, _syllogism, _riddle])(r),
        "math": _math,
        "coding": lambda r: r.choice([
            f"Write a {r.choice(CODE_LANGS)} function that {r.choice(CODE_TASKS)}.",
            f"Explain {r.choice(CODE_EXPLAIN)} with a short {r.choice(CODE_LANGS[:3])} example.",
            r.choice(SNIPPET_ASKS).format(x=r.choice(SNIPPETS)),
        ]),
        "extraction": _extraction,
        "stem": lambda r: _filled(r, STEM),
        "humanities": lambda r: _filled(r, HUMANITIES),
        "translation": lambda r: r.choice([
            f"Translate into {r.choice(LANGS)}: \"{r.choice(SENTENCES)}\"",
            f"Translate into {r.choice(LANGS)}: \"{r.choice(SENTENCES)}\"",
            f"Translate into English: \"{r.choice(FOREIGN)}\"",
        ]),
        "summarization": lambda r: r.choice([
            r.choice(SUMMARY_ASKS).format(x=r.choice(PASSAGES)),
            f"Read the passage and answer: {r.choice(PASSAGE_QUESTIONS)}\nPassage: \"{r.choice(PASSAGES)}\"",
        ]),
        "qa": lambda r: r.choice(QA),
        "math_reasoning": _math_reasoning,
        "rag": _rag,
        "general": lambda r: r.choice(EXPLAIN_TASKS).format(x=r.choice(ACTIVITIES)),
    }


def _ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


class HeldOut:
    """Held-out prompts, for overlap checks: exact text or any shared ``n``-word sequence."""

    def __init__(self, texts: list[str], n: int = 8):
        self.n = n
        self.texts = {t.strip() for t in texts}
        self.grams = set().union(*(_ngrams(t, n) for t in texts)) if texts else set()

    def overlaps(self, text: str) -> bool:
        return text.strip() in self.texts or bool(_ngrams(text, self.n) & self.grams)


def held_out_texts() -> list[str]:
    """The built-in evaluation prompts, which no generated training prompt may overlap."""
    from ..data import builtin_prompts

    return [t for _, t in builtin_prompts()]


def check_held_out(pairs: list[tuple[str, str]], held: list[str]) -> None:
    """Raise if any generated ``(category, prompt)`` pair overlaps ``held`` (the generators never let one through)."""
    guard = HeldOut(held)
    if any(guard.overlaps(t) for _, t in pairs):
        raise RuntimeError("training prompts overlap the built-in prompts")


STYLE = ["", "", "", " Keep it short.", " Explain step by step.", " Use simple language.",
         " Answer in a few sentences."]


def training_prompts(n: int, seed: int, held_out: list[str]) -> list[tuple[str, str]]:
    """``n`` distinct ``(category, prompt)`` pairs, spread evenly over the categories (as far as each category's
    variety allows) and interleaved, none overlapping ``held_out``."""
    rng = random.Random(seed)
    held = HeldOut(held_out)
    gens = _generators()
    per = -(-n // len(gens))
    pools, seen = {}, set()
    for cat, gen in gens.items():
        pool, tries = [], 0
        while len(pool) < 2 * per and tries < 40 * per:
            tries += 1
            text = gen(rng) + rng.choice(STYLE)
            if text in seen or held.overlaps(text):
                continue
            seen.add(text)
            pool.append((cat, text))
        pools[cat] = pool
    out, i = [], 0
    while len(out) < n:
        live = [c for c in pools if i < len(pools[c])]
        if not live:
            raise RuntimeError(f"could only make {len(out)} distinct training prompts")
        out.extend(pools[c][i] for c in live)
        i += 1
    return out[:n]


# ------------------------------------------------------------------------------------ broad prompts (second set)
# Any topic under any kind of request: far more distinct answers than the tables above, whose few hundred fillers
# a head memorises. Passages for the context kinds (summarise, answer from a text, rewrite) are the target's own
# earlier answers, so these prompts copy from text the way Spec-Bench's summarization and rag prompts do.

TOPICS = """volcanoes|coral reefs|honey bees|the water cycle|black holes|the immune system|sleep|vaccines|rainforests|
deserts|glaciers|earthquakes|the moon|Mars|comets|the solar wind|electric cars|solar panels|nuclear power|
wind farms|recycling plastic|composting|urban gardening|beekeeping|bird migration|whales|octopuses|wolves|
elephants|ants|mushrooms|ferns|cacti|tomatoes|coffee|chocolate|bread baking|fermentation|cheese making|olive oil|
rice farming|tea ceremonies|street food|vegetarian cooking|spices|knitting|pottery|woodworking|origami|
photography|watercolour painting|sculpture|calligraphy|jazz|opera|hip hop|folk music|the violin|the piano|drums|
film editing|animation|video games|chess|board games|football|basketball|tennis|swimming|cycling|marathon running|
yoga|rock climbing|sailing|skiing|camping|hiking boots|maps|lighthouses|bridges|skyscrapers|tunnels|railways|
airports|container ships|the printing press|the telegraph|radio|television|smartphones|the internet|email|
passwords|encryption|databases|spreadsheets|compilers|operating systems|computer viruses|cloud computing|
open-source software|robots|drones|3D printing|artificial intelligence|machine translation|search engines|
social media|online shopping|credit cards|inflation|interest rates|taxes|budgeting|saving for retirement|
starting a small business|job interviews|writing a CV|teamwork|leadership|time management|procrastination|
public speaking|learning a language|homeschooling|libraries|museums|newspapers|podcasts|poetry|fairy tales|
detective novels|science fiction|Shakespeare|ancient Egypt|ancient Rome|the Vikings|the Silk Road|the Aztecs|
medieval castles|the Renaissance|the Industrial Revolution|the Cold War|the space race|democracy|human rights|
elections|the United Nations|city planning|public transport|traffic jams|noise pollution|air quality|
drinking water|floods|droughts|hurricanes|climate change|biodiversity|endangered species|national parks|
zoos|pets|training a puppy|cats|horses|aquariums|first aid|healthy breakfasts|vitamins|exercise at home|
running injuries|stress|meditation|friendship|grandparents|moving house|noisy neighbours|wedding planning|
birthday parties|holidays by train|packing a suitcase|hotels|camping stoves|weather forecasts|rainbows|
thunderstorms|snow|tides|magnets|electricity|batteries|light bulbs|lasers|microscopes|telescopes|satellites|
GPS|clocks|calendars|prime numbers|fractions|probability|statistics|geometry|algebra|the number zero|
sorting algorithms|recursion|binary numbers|spreadsheets formulas|plumbing|fixing a bicycle|painting a room|
houseplants|lawn care|bees in cities|electric scooters|car maintenance|driving lessons|airline delays|
lost luggage|customer service|restaurant reviews|minimalism|second-hand clothes|fashion|perfume|soap making|
candles|dinosaurs|fossils|volcanic islands|the Arctic|Antarctica|the Amazon river|the Sahara|the Alps|
the Pacific Ocean|penguins|sharks|dolphins|butterflies|spiders|owls|crows|forests in autumn|
the history of money|the Olympic Games|chess champions|famous inventors|women in science|space telescopes|
the human brain|memory|dreams|left-handedness|optical illusions|laughter|music therapy|languages that died|
sign language|handwriting|typewriters|vinyl records|cinema history|comic books|theme parks|circus|
firefighters|nurses|farmers|teachers|astronauts|architects|librarians|bakers|pilots|lifeguards""".replace("\n", "")

ASKS = {
    "writing": ["Write a short blog post about {t}.", "Write a poem about {t}.", "Write a short story in which {t} "
                "play an important part.", "Write a persuasive paragraph about {t}.", "Write a news report about "
                "something surprising involving {t}.", "Write a letter to a friend about {t}.", "Write a short "
                "essay on {t}.", "Write an advertisement that mentions {t}.", "Write a speech for a school event "
                "about {t}.", "Write a diary entry about a day spent learning about {t}."],
    "roleplay": ["Pretend you are an expert on {t}. Introduce yourself to a class of students.", "You are a tour "
                 "guide. Describe {t} to a group of visitors.", "Act as a teacher and explain {t} to a ten-year-old.",
                 "Imagine you are a journalist interviewing someone who knows all about {t}. Write the first "
                 "questions and answers.", "Pretend you are a shop assistant selling something related to {t}."],
    "reasoning": ["What are the pros and cons of {t}?", "Give three arguments for and three against {t}.",
                  "What would happen if {t} disappeared tomorrow? Think it through.", "How are {t} and {u} alike, "
                  "and how are they different?", "What mistakes do beginners make with {t}, and why?"],
    "stem": ["Explain {t} in simple terms.", "How does {t} work?", "What is the science behind {t}?",
             "Give three surprising facts about {t}.", "What are common misconceptions about {t}?"],
    "humanities": ["What is the history of {t}?", "How has {t} changed over the last hundred years?", "Why do "
                   "people care about {t}?", "How do different cultures think about {t}?"],
    "qa": ["What is {t}?", "Why is {t} important?", "Who uses {t}, and for what?", "What should I know about {t} "
           "before I start?", "Where can I learn more about {t}?"],
    "general": ["Give me five tips about {t}.", "Make a step-by-step plan for getting started with {t}.", "List "
                "the most important things to know about {t}.", "What questions should I ask about {t}?",
                "Recommend some ways to enjoy {t} on a small budget."],
    "coding": ["Write a {lang} program that stores facts about {t} and prints them.", "Design a small {lang} class "
               "that models {t}. Explain the fields.", "Write a {lang} function that counts how often the word "
               "'{w}' appears in a text."],
}

PASSAGE_ASKS = {
    "summarization": ["Summarize this text in two sentences:\n\"{p}\"", "Write a one-line headline for this text:"
                      "\n\"{p}\"", "What are the three main points of the following text?\n\"{p}\""],
    "rag": ["Use the text to answer the question.\nText: \"{p}\"\nQuestion: What does the text say about {w}?",
            "Answer using only the passage below.\nPassage: \"{p}\"\nQuestion: What is the main idea?"],
    "extraction": ["List every name, number and place mentioned in this text:\n\"{p}\"", "Rewrite this text as "
                   "a bulleted list:\n\"{p}\"", "Rewrite this text in simpler words:\n\"{p}\""],
    "translation": ["Translate the first sentence of this text into {lang2}:\n\"{p}\""],
}


def broad_prompts(n: int, seed: int, held_out: list[str], passages: list[str]) -> list[tuple[str, str]]:
    """``n`` distinct ``(category, prompt)`` pairs: any of ``TOPICS`` under any of ``ASKS``, and ``passages``
    (texts of a few sentences) under ``PASSAGE_ASKS`` for about a quarter of them; none overlapping ``held_out``."""
    rng = random.Random(seed)
    held = HeldOut(held_out)
    topics = [t.strip() for t in TOPICS.split("|") if t.strip()]
    out, seen, tries = [], set(), 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n:
            raise RuntimeError(f"could only make {len(out)} distinct broad prompts")
        use_passage = passages and rng.random() < 0.25
        cat = rng.choice(list(PASSAGE_ASKS if use_passage else ASKS))
        template = rng.choice((PASSAGE_ASKS if use_passage else ASKS)[cat])
        p = rng.choice(passages) if use_passage else ""
        words = re.findall(r"[A-Za-z]{5,}", p) or topics
        text = template.format(t=rng.choice(topics), u=rng.choice(topics), lang=rng.choice(CODE_LANGS),
                               lang2=rng.choice(LANGS), p=p, w=rng.choice(words).lower()) + rng.choice(STYLE)
        if text in seen or held.overlaps(text):
            continue
        seen.add(text)
        out.append((cat, text))
    return out
