"""Write ``configs/train/prompts_train_large.txt``: ~4000 diverse, distinct user prompts (one per
line) for generating draft-model training data with SmolLM2-135M-Instruct.

Standard library only and deterministic (``random.Random(SEED)``)::

    python scripts/make_prompts.py                      # -> configs/train/prompts_train_large.txt
    python scripts/make_prompts.py --n 2000 --out /tmp/p.txt

Prompts come from ~30 task families (code, math, translation, lists, emails, recipes, how-to,
explanations, creative writing, summaries, comparisons, trivia, rewriting, classification, data
formatting, brainstorming, role-play, ...) each with several phrasings, filled from subject
lists. Held-out evaluation prompts stay unseen: any prompt equal (case-insensitive, whitespace
normalised) to a line of ``configs/bench/prompts.txt`` or ``configs/train/prompts_heldout.txt``
is dropped (and asserted absent at the end), and so is any prompt containing a BANNED substring
(the subjects of the benchmark prompts).
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

SEED = 20240611
ROOT = Path(__file__).resolve().parent.parent
EXCLUDE_FILES = [ROOT / "configs/bench/prompts.txt", ROOT / "configs/train/prompts_heldout.txt"]

# Subjects of the benchmark prompts: never generated (checked case-insensitively).
BANNED = [
    "poem about the sea", "about the sea", "hash table", "hashtable", "hash map", "hashmap",
    "factorial", "capital of france", "focused while studying", "staying focused", "romeo",
    "juliet", "good morning, how are you", "haiku about autumn", "autumn leaves", "green tea",
    "cup of tea", "counts the rows", "count the rows", "number of rows", "table named users",
    "planets", "solar system", "sky blue", "sky is blue", "sky look blue", "reschedul",
    "repeat the word", "hello", "describe a cat", "prime number", "first ten prime",
]

# --------------------------------------------------------------------------------------- data
LANGS = ["Python", "JavaScript", "C", "Java", "TypeScript", "Go", "Rust", "C++", "Ruby"]
FUNC_TASKS = [
    "reverses a string", "checks whether a string is a palindrome", "counts the vowels in a string",
    "returns the largest number in a list", "removes duplicates from a list while keeping order",
    "merges two sorted lists into one sorted list", "converts Celsius to Fahrenheit",
    "returns the nth Fibonacci number", "checks whether a year is a leap year",
    "finds the second largest element in an array", "flattens a nested list",
    "capitalizes the first letter of every word in a sentence", "counts how often each word appears in a text",
    "computes the average of a list of numbers", "returns the greatest common divisor of two integers",
    "checks whether two strings are anagrams", "sums the digits of an integer",
    "converts a decimal number to binary", "rotates an array by k positions",
    "finds the most common character in a string", "returns the intersection of two lists",
    "splits a list into chunks of size n", "validates that a password has at least 8 characters and one digit",
    "converts a Roman numeral to an integer", "performs binary search on a sorted array",
    "sorts an array using bubble sort", "computes the power of a number without using a built-in",
    "checks whether a number is a perfect square", "removes all whitespace from a string",
    "returns the length of the longest word in a sentence", "transposes a 2D matrix",
    "counts the number of lines in a text file", "generates a random password of a given length",
    "converts a string to title case", "checks if a list is sorted", "finds the missing number in a list from 1 to n",
    "returns the running total of a list", "truncates a string to n characters and adds an ellipsis",
    "computes the distance between two points", "returns the day of the week for a given date",
]
CONCEPTS = {
    "Python": ["list comprehensions", "decorators", "generators", "context managers", "f-strings",
               "dataclasses", "*args and **kwargs", "lambda functions", "exception handling", "virtual environments"],
    "JavaScript": ["promises", "async/await", "closures", "arrow functions", "the spread operator",
                   "destructuring", "event listeners", "Array.map and Array.filter", "let vs var", "JSON.parse"],
    "C": ["pointers", "malloc and free", "structs", "header files", "pointer arithmetic", "the switch statement"],
    "Java": ["interfaces", "inheritance", "ArrayList", "exceptions", "static methods", "the StringBuilder class"],
    "Bash": ["for loops", "pipes", "environment variables", "if statements", "command substitution", "grep"],
    "SQL": ["JOINs", "GROUP BY", "subqueries", "indexes", "primary keys", "the HAVING clause"],
}
BASH_TASKS = [
    "renames every .txt file in a folder to .md", "counts the files in the current directory",
    "prints the 10 largest files under a directory", "backs up a folder into a dated tar.gz archive",
    "finds all lines containing ERROR in a log file", "deletes files older than 30 days in /tmp/cache",
    "prints the disk usage of each subfolder", "loops over numbers 1 to 5 and prints their squares",
    "checks whether a file exists before reading it", "replaces every 'foo' with 'bar' in all .cfg files",
    "shows the 5 most frequent words in a text file", "prints the current date in YYYY-MM-DD format",
]
SQL_TASKS = [
    "finds the top 5 customers by total order amount, using tables customers and orders",
    "lists all employees hired after 2020, from a table employees(name, hire_date)",
    "returns the average salary per department from a table employees(name, department, salary)",
    "finds products that have never been ordered, using tables products and order_items",
    "deletes duplicate emails from a table contacts(id, email), keeping the lowest id",
    "shows the number of orders per month in 2023 from a table orders(id, created_at)",
    "finds the second highest salary in a table employees",
    "lists books and their authors, joining tables books(author_id) and authors(id, name)",
    "updates the price of every item in category 'toys' by 10 percent",
    "creates a table for storing blog posts with a title, body and publish date",
    "selects students whose grade is above the class average from a table students(name, grade)",
    "finds cities with more than three stores from a table stores(id, city)",
]
UNIT_TEST_TARGETS = ["a function add(a, b)", "a function is_even(n)", "a function that slugifies a title",
                     "a function that parses a date string", "a shopping cart total function",
                     "a function that reverses a string", "a function that validates email addresses"]
FIX_SNIPPETS = [
    ("Python", "def f(x) return x*2"),
    ("Python", "for i in range(10) print(i)"),
    ("Python", "if x = 5: print('five')"),
    ("Python", "def greet(name): print('Hi ' + name) greet()"),
    ("Python", "nums = [1, 2, 3]; print(nums[3])"),
    ("Python", "total = '5' + 3"),
    ("Python", "def add(a, b): return a + b print(add(2))"),
    ("Python", "with open('data.txt') as f: lines = f.readlines; print(len(lines))"),
    ("Python", "d = {'a': 1}; print(d['b'])"),
    ("JavaScript", "const x = 5; x = 10; console.log(x);"),
    ("JavaScript", "function sum(a, b) { return a + b } console.log(sum(1, '2'));"),
    ("JavaScript", "for (let i = 0; i < arr.length; i++) { if (arr[i] = 3) console.log(i); }"),
    ("JavaScript", "let items = [1,2,3]; items.forEach(i => { return i * 2 }); console.log(items);"),
    ("JavaScript", "fetch(url).then(res => res.json).then(data => console.log(data));"),
    ("C", "int main() { int a[3] = {1,2,3}; printf(\"%d\", a[3]); }"),
    ("C", "char *s; strcpy(s, \"hi\");"),
    ("C", "int x = 10; if (x = 5) printf(\"five\");"),
    ("C", "for (int i = 0; i <= 10; i++); { printf(\"%d\\n\", i); }"),
    ("Java", "String s = null; System.out.println(s.length());"),
    ("Java", "int[] a = new int[5]; for (int i = 0; i <= 5; i++) a[i] = i;"),
    ("Java", "if (name == \"Bob\") { System.out.println(\"hi Bob\"); }"),
    ("Java", "public int max(int a, int b) { if (a > b) return a; }"),
    ("Bash", "for f in *.txt do echo $f done"),
    ("Bash", "if [ $x -eq 5 ] then echo five fi"),
    ("Bash", "name = \"Ann\"; echo $name"),
    ("SQL", "SELECT name, COUNT(*) FROM orders;"),
    ("SQL", "SELECT * FROM products WHERE price > 10 ORDER price;"),
    ("SQL", "SELECT * FROM employees WHERE manager_id = NULL;"),
    ("Go", "func add(a int, b int) int { a + b }"),
    ("Rust", "let v = vec![1, 2, 3]; v.push(4);"),
]
ONE_LINERS = [
    ("Python", "print([x**2 for x in range(5) if x % 2 == 0])"),
    ("Python", "s[::-1]"),
    ("Python", "dict(zip(keys, values))"),
    ("Python", "sorted(words, key=len, reverse=True)"),
    ("Python", "sum(1 for line in open('f.txt'))"),
    ("Python", "any(c.isdigit() for c in password)"),
    ("Python", "list(map(int, input().split()))"),
    ("Python", "max(scores, key=scores.get)"),
    ("JavaScript", "const unique = [...new Set(arr)];"),
    ("JavaScript", "arr.reduce((a, b) => a + b, 0)"),
    ("JavaScript", "str.split('').reverse().join('')"),
    ("JavaScript", "const { name, age } = user;"),
    ("JavaScript", "document.querySelectorAll('p').forEach(p => p.remove());"),
    ("JavaScript", "Object.keys(obj).length === 0"),
    ("C", "while (*dst++ = *src++);"),
    ("C", "x ^= y; y ^= x; x ^= y;"),
    ("C", "int n = sizeof(arr) / sizeof(arr[0]);"),
    ("Java", "list.stream().filter(s -> s.startsWith(\"a\")).count()"),
    ("Java", "String.join(\", \", names)"),
    ("Bash", "find . -name '*.log' -mtime +7 -delete"),
    ("Bash", "cat access.log | cut -d' ' -f1 | sort | uniq -c | sort -nr | head"),
    ("Bash", "du -sh * | sort -h"),
    ("Bash", "grep -rl 'TODO' src/"),
    ("Bash", "tar -czf backup.tar.gz ~/documents"),
    ("SQL", "SELECT department, AVG(salary) FROM staff GROUP BY department HAVING AVG(salary) > 50000;"),
    ("SQL", "SELECT DISTINCT city FROM customers ORDER BY city;"),
]
REGEX_TARGETS = [
    "a US phone number like 555-123-4567", "a date in YYYY-MM-DD format", "a hex color code such as #1a2b3c",
    "an email address", "a five-digit ZIP code", "a time in 24-hour HH:MM format", "an IPv4 address",
    "a word that starts with a capital letter", "a URL that starts with https", "a string made only of digits",
    "two repeated words in a row, like 'the the'", "a British postcode", "a price like $19.99",
    "a username of 3 to 16 letters, digits or underscores", "lines that end with a semicolon",
]
REGEXES = [r"^\d{3}-\d{4}$", r"^[A-Za-z]+$", r"\b\w+@\w+\.com\b", r"^(\+\d{1,2}\s)?\d{10}$",
           r"(\d+)\s*(kg|g)", r"^#?([a-f0-9]{6})$", r"\s+$", r"^[^aeiou]*$"]
CS_TOPICS = [
    "recursion", "big-O notation", "a REST API", "object-oriented programming", "a linked list",
    "a binary search tree", "version control with git", "a race condition", "caching", "an API key",
    "garbage collection", "a Docker container",
    "DNS", "an HTTP status code", "public-key encryption", "unit testing", "a database index", "JSON",
    "an operating system", "a for loop",
    "cloud computing", "a neural network", "dynamic programming", "a memory leak", "multithreading",
    "a regular expression", "a CSV file", "Unicode", "a virtual machine", "HTTPS", "a browser cookie",
]
SCIENCE_TOPICS = [
    "inflation", "supply and demand", "the water cycle", "evolution by natural selection", "how vaccines work",
    "plate tectonics", "the greenhouse effect", "how rainbows form", "electricity", "magnetism",
    "how airplanes fly", "the theory of relativity", "entropy", "how the heart pumps blood",
    "how batteries work", "the carbon cycle", "why leaves change color", "how earthquakes happen",
    "what an atom is", "how the internet works", "how a refrigerator keeps food cold", "the placebo effect",
    "opportunity cost", "interest rates", "how bees make honey", "how sound travels", "nuclear fusion",
    "how GPS works", "the difference between weather and climate", "how a microwave oven heats food",
    "what a gene is", "the Doppler effect", "how muscles grow", "what causes the seasons", "how a bill becomes law",
    "antibiotics", "how clouds form", "how a credit score works", "osmosis", "what a recession is",
    "how lightning forms", "how solar panels work", "what causes thunder", "how memory works in the brain",
    "how sleep affects health", "how a camera lens focuses light", "what a calorie is", "how taxes work",
]
LEVELS = ["in simple terms", "to a five-year-old", "to a high school student", "in two sentences",
          "in one short paragraph", "using an everyday analogy", "as if I were a complete beginner",
          "in three bullet points", "to a university student", "without using jargon"]
WORDS_TO_DEFINE = [
    "serendipity", "ephemeral", "ubiquitous", "nostalgia", "irony", "photosynthesis", "metaphor",
    "democracy", "algorithm", "biodiversity", "empathy", "procrastination", "a haiku", "a sonnet",
    "gross domestic product", "a mortgage", "a dividend", "a budget deficit", "an ecosystem", "a hypothesis",
    "gentrification", "stoicism", "a palindrome", "an idiom", "an oxymoron", "a carbon footprint",
    "resilience", "cryptocurrency", "a pandemic", "a filibuster", "minimalism", "the Renaissance",
]
SENTENCES_EN = [
    "Where is the nearest train station?", "I would like a coffee with milk, please.",
    "The weather is beautiful today.", "Can you help me find my keys?", "My brother lives in a small town.",
    "What time does the museum open?", "I am learning to play the guitar.", "Thank you very much for your help.",
    "We are going to the beach this weekend.", "How much does this jacket cost?", "I don't understand the question.",
    "The library closes at eight o'clock.", "She reads a book every week.", "Please turn off the lights.",
    "Do you have a table for two?", "I have been waiting for twenty minutes.", "It is raining again.",
    "My favorite color is green.", "The children are playing in the park.", "Could you speak more slowly?",
    "I lost my passport at the airport.", "Happy birthday, I hope you have a wonderful day!",
    "The meeting starts at nine tomorrow.", "This soup is too salty.", "I need to buy bread and eggs.",
    "Excuse me, where is the bathroom?", "We adopted a puppy last month.", "The train is late.",
]
TARGET_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Japanese", "Chinese",
                "Korean", "Russian", "Arabic", "Turkish", "Swedish", "Polish"]
FOREIGN = [
    ("French", "Je voudrais réserver une chambre pour deux nuits."), ("French", "Il fait très froid ce matin."),
    ("French", "Où se trouve la bibliothèque ?"), ("Spanish", "¿Dónde está la estación de autobuses?"),
    ("Spanish", "Me gusta mucho cocinar con mi familia."), ("Spanish", "Mañana vamos al mercado."),
    ("German", "Ich habe meinen Regenschirm vergessen."), ("German", "Wie spät ist es?"),
    ("German", "Das Essen war sehr lecker."), ("Italian", "Vorrei un bicchiere d'acqua, per favore."),
    ("Italian", "Il treno parte alle sei."), ("Portuguese", "Eu moro perto da praia."),
    ("Dutch", "Ik fiets elke dag naar mijn werk."), ("Spanish", "No sé dónde dejé mis gafas."),
]
LIST_THINGS = [
    "fruits that are high in vitamin C", "famous Renaissance painters", "board games for a family night",
    "indoor plants that are hard to kill", "healthy breakfast ideas", "European capitals", "African countries",
    "mammals that live in the ocean", "programming languages used for web development", "classic novels everyone should read",
    "ways to save money on groceries", "inventions from the 20th century", "musical instruments in an orchestra",
    "Olympic sports", "dog breeds that are good with kids", "things to pack for a camping trip",
    "vegetables that grow well in containers", "famous female scientists", "Greek gods and their roles",
    "hobbies you can start at home", "countries in South America", "birds that cannot fly", "types of clouds",
    "spices used in Indian cooking", "ways to reduce plastic waste", "questions to ask in a job interview",
    "rivers in Asia", "famous bridges around the world", "mountain ranges", "common job interview mistakes",
    "kinds of pasta", "team-building activities", "desert animals", "words that rhyme with light",
    "synonyms for happy", "antonyms for brave", "cheap date ideas", "ways to stay warm in winter",
    "ancient civilizations", "famous composers", "chess openings", "stretching exercises for the back",
    "uses for baking soda", "reasons to learn a second language", "famous landmarks in Asia",
    "cheeses from Italy", "rainy day activities for kids", "apps for learning languages",
    "signs that a plant needs more water", "common logical fallacies", "ways to be a better listener",
    "Shakespeare plays other than the tragedies", "dinosaurs", "national parks in the United States",
]
LIST_OPEN = ["List five {x}.", "Name three {x}.", "Give me a list of seven {x}.", "What are some {x}?",
             "Can you list ten {x}?", "List four {x} with one sentence about each."]
EMAILS = [  # (purpose, plausible recipients)
    ("asking for a day off next Friday", ["my manager", "my team lead"]),
    ("following up on a job application", ["the hiring manager", "a recruiter"]),
    ("apologizing for missing a deadline", ["my manager", "a client", "a professor"]),
    ("thanking them for their help on a project", ["a coworker", "my team", "a mentor"]),
    ("reporting a broken heater", ["my landlord", "the building manager"]),
    ("requesting a refund for a damaged order", ["an online store", "customer service"]),
    ("introducing myself as the new project lead", ["my team", "a client", "the design department"]),
    ("asking for feedback on my presentation", ["my manager", "a coworker", "a mentor"]),
    ("declining an invitation to speak at a conference", ["an event organizer"]),
    ("asking for an extension on an assignment", ["a professor", "my teacher"]),
    ("requesting a letter of recommendation", ["a professor", "a former manager"]),
    ("announcing that the office will be closed on Monday", ["all staff", "our customers"]),
    ("complaining about noise late at night", ["my neighbor", "my landlord"]),
    ("asking about the status of an unpaid invoice", ["a client", "the accounts team"]),
    ("sharing the notes from today's call", ["my team", "a client"]),
    ("welcoming a new team member", ["my team", "a new hire"]),
    ("asking for a raise", ["my manager"]),
    ("confirming the details of an order", ["a supplier", "a customer"]),
    ("inviting them to a farewell lunch", ["my coworkers", "the whole department"]),
    ("asking about my child's progress in math", ["my child's teacher"]),
    ("explaining a delay in a shipment", ["a customer", "a client"]),
    ("proposing a new weekly team meeting", ["my team", "my manager"]),
]
MSG_KINDS = ["a short email to {r} {p}.", "a polite email to {r} {p}.", "a brief, friendly message to {r} {p}.",
             "a formal letter to {r} {p}."]
NOTES = ["a thank-you note to a friend who helped me move", "a birthday message for my grandmother",
         "a congratulations message for a coworker's promotion", "a get-well-soon card for a neighbor",
         "a condolence message to a colleague", "a wedding toast for my best friend",
         "an out-of-office reply for a two-week vacation", "a cover letter opening for a junior data analyst role",
         "a LinkedIn summary for a graphic designer", "a short bio for a yoga instructor's website",
         "a text message to cancel dinner plans", "a note to a teacher explaining my son's absence",
         "a welcome message for new members of a book club", "a thank-you email after a job interview",
         "an apology text to a friend for forgetting their birthday", "a product review for wireless earbuds",
         "a short speech for a retirement party", "a rental listing for a cozy one-bedroom apartment"]
DISHES = [
    "pancakes", "a simple tomato pasta sauce", "guacamole", "banana bread", "fried rice", "chocolate chip cookies",
    "a vegetable stir-fry", "hummus", "scrambled eggs", "chicken curry", "lentil soup", "homemade pizza dough",
    "a Greek salad", "French toast", "mashed potatoes", "overnight oats", "a fruit smoothie", "roast chicken",
    "vegetable lasagna", "a basic vinaigrette", "tacos", "pad thai", "miso soup", "shakshuka", "risotto",
    "apple crumble", "lemonade", "hot chocolate", "a grilled cheese sandwich", "beef chili", "spring rolls",
    "potato salad", "brownies", "tomato soup", "a caesar salad", "garlic bread", "crepes", "falafel",
]
COOK_OPEN = ["How do I make {d}?", "Give me a simple recipe for {d}.", "What ingredients do I need for {d}?",
             "Walk me through making {d} step by step.", "What's an easy way to make {d} for beginners?",
             "How can I make {d} healthier?"]
INGREDIENTS = ["eggs", "rice", "spinach", "chickpeas", "chicken", "potatoes", "tomatoes", "onions", "cheese",
               "pasta", "tofu", "mushrooms", "carrots", "canned tuna", "bread", "bananas", "yogurt", "lentils"]
COOK_Q = ["How long should I boil an egg for a runny yolk?", "What can I use instead of butter in baking?",
          "How do I keep rice from getting sticky?", "What is the difference between baking soda and baking powder?",
          "How do I know when chicken is fully cooked?", "How do I sharpen a kitchen knife?",
          "Why did my bread not rise?", "How do I store fresh herbs so they last longer?",
          "What's the best way to cut an onion without crying?", "How do I caramelize onions?",
          "Can I freeze cooked pasta?", "How do I make my cookies chewier?", "What is a roux and how do I make one?",
          "How do I cook quinoa?", "What oil is best for deep frying?", "How do I ripen an avocado faster?",
          "What can I substitute for eggs in a cake?", "How do I soften brown sugar that has gone hard?"]
HOWTO_TASKS = [
    "change a flat tire", "remove a coffee stain from a white shirt", "unclog a bathroom sink",
    "set up a monthly budget", "start running as a beginner", "write a good resume", "plant tomatoes",
    "clean a cast-iron pan", "back up my phone", "tie a tie", "create a strong password",
    "prepare for a job interview", "train a puppy to sit", "reduce my screen time", "learn to touch type",
    "start a vegetable garden on a balcony", "negotiate a higher salary", "fall asleep faster",
    "make my houseplants grow better", "improve my handwriting", "fix a squeaky door", "hang a picture straight",
    "jump-start a car", "organize a small closet", "write a haiku", "start journaling", "meal prep for a week",
    "clean my laptop keyboard", "speed up a slow computer", "make new friends in a new city",
    "prepare for a long flight", "care for a succulent", "paint a room", "iron a dress shirt",
    "give a good presentation", "save for a vacation", "set up two-factor authentication",
    "learn a new language on my own", "wash a wool sweater", "build a simple bookshelf",
    "memorize a speech", "start a podcast", "compost at home", "read more books", "make a paper airplane that flies far",
]
HOWTO_OPEN = ["How do I {t}?", "What's the best way to {t}?", "Give me step-by-step instructions to {t}.",
              "Walk me through how to {t}.", "I'm a beginner. How can I {t}?", "Explain how to {t} in five steps."]
TIP_GOALS = [
    "sleeping better", "saving money", "public speaking", "learning to code", "keeping a tidy home",
    "writing clearer emails", "running a first marathon", "traveling on a budget", "taking better photos with a phone",
    "managing stress at work", "making a long-distance move", "eating more vegetables", "staying motivated to exercise",
    "being more productive in the morning", "starting a small business", "keeping a conversation going",
    "reducing food waste", "staying safe while hiking", "remembering names", "working from home",
    "preparing for an exam", "raising a teenager", "caring for an elderly parent", "writing a novel",
    "learning chess", "making friends as an adult", "driving in the snow", "keeping a plant alive",
]
TIP_OPEN = ["Give me three tips for {g}.", "What are some good tips for {g}?", "Share five quick tips for {g}.",
            "Any advice on {g}?", "What are the most common mistakes people make when {g}?"]
CREATIVE_SUBJECTS = [
    "the moon", "a rainy afternoon", "coffee", "a lighthouse", "city lights at night", "an old oak tree", "friendship",
    "a snowy morning", "the first day of spring", "a lost umbrella", "mountains", "a busy train station", "the desert",
    "a dog waiting at the door", "homework", "a thunderstorm", "a garden", "summer vacation", "a grandmother's kitchen",
    "a robot learning to paint", "the stars", "a bicycle ride", "a library", "fireflies", "a quiet village",
    "the wind", "a candle", "moving to a new city", "a broken clock", "a sunflower", "bread baking", "a river",
    "Monday mornings", "a penguin", "the night sky", "waking up early", "a hot air balloon", "a lemon tree",
    "a forgotten letter", "a marathon runner", "a fox in the snow", "time", "an empty playground", "a volcano",
    "a football match", "a train journey", "rain on a tin roof", "a honeybee", "a lighthouse keeper", "silence",
]
CREATIVE_OPEN = ["Write a haiku about {s}.", "Write a limerick about {s}.", "Write a four-line poem about {s}.",
                 "Write a short rhyming poem about {s}.", "Write a free-verse poem about {s}.",
                 "Write a very short story about {s}.", "Write a two-sentence horror story about {s}.",
                 "Write a short song chorus about {s}.", "Write an acrostic poem about {s}.",
                 "Write a funny poem about {s} for kids.", "Describe {s} in vivid detail in one paragraph."]
CHARACTERS = ["a shy dragon", "a retired astronaut", "a talking teapot", "a detective who is afraid of the dark",
              "a young baker", "a lonely robot", "a grumpy wizard", "a lost tourist", "a curious squirrel",
              "a time traveler from 1850", "two rival chefs", "a nervous substitute teacher", "an old fisherman",
              "a ghost who wants to be helpful", "a girl who can talk to plants", "a knight who hates horses"]
SITUATIONS = ["finds a mysterious map", "has to give a speech", "wakes up in a different city", "loses a bet",
              "tries to cook dinner for the first time", "makes an unexpected friend", "gets stuck in an elevator",
              "enters a baking contest", "discovers a hidden door", "has one day to save the town"]
DIALOGUE_PAIRS = [("a customer", "a barista"), ("a student", "a teacher"), ("two friends", None),
                  ("a doctor", "a patient"), ("a job applicant", "an interviewer"), ("a tourist", "a local"),
                  ("a parent", "a teenager"), ("a detective", "a suspect"), ("a pilot", "a passenger")]
DIALOGUE_TOPICS = ["a delayed flight", "choosing a movie", "a missing wallet", "homework", "a new job",
                   "weekend plans", "a strange noise", "the best pizza in town", "climate change", "a broken phone"]
BOOKS = [
    "Pride and Prejudice", "1984", "To Kill a Mockingbird", "The Great Gatsby", "Moby-Dick", "The Hobbit",
    "Frankenstein", "Hamlet", "Macbeth", "The Odyssey", "Don Quixote", "Jane Eyre", "The Catcher in the Rye",
    "Animal Farm", "Little Women", "The Little Prince", "Crime and Punishment", "Harry Potter and the Philosopher's Stone",
    "The Lord of the Rings", "Alice's Adventures in Wonderland", "Brave New World", "Of Mice and Men",
    "Charlotte's Web", "The Alchemist", "Wuthering Heights", "Dracula", "Treasure Island", "Les Misérables",
    "A Christmas Carol", "Lord of the Flies", "Fahrenheit 451",
]
FILMS = ["The Lion King", "Titanic", "Jurassic Park", "Finding Nemo", "Star Wars: A New Hope", "The Wizard of Oz",
         "Back to the Future", "Toy Story", "The Matrix", "Jaws", "Forrest Gump", "Spirited Away", "Casablanca",
         "Up", "Inception", "Frozen", "The Godfather", "E.T. the Extra-Terrestrial"]
EVENTS = ["the fall of the Roman Empire", "the American Revolution", "the moon landing in 1969", "the Industrial Revolution",
          "the fall of the Berlin Wall", "World War I", "the Black Death", "the invention of the printing press",
          "the signing of the Magna Carta", "the Cold War", "the Renaissance", "the building of the pyramids of Giza",
          "the voyages of Christopher Columbus", "the Russian Revolution", "the end of apartheid in South Africa",
          "the Great Depression", "the discovery of penicillin", "the first powered flight by the Wright brothers",
          "the Meiji Restoration", "the Protestant Reformation", "the Civil Rights Movement in the United States",
          "the founding of the United Nations", "the eruption of Mount Vesuvius in 79 AD", "the Apollo 13 mission"]
SUMMARY_OPEN = {"book": ["Summarize the plot of {x} in a few sentences.", "What is {x} about?",
                         "Give me a spoiler-free summary of {x}.", "What are the main themes of {x}?",
                         "Who are the main characters in {x}?", "Summarize {x} in one sentence."],
                "film": ["Summarize the movie {x} in three sentences.", "What happens in the film {x}?",
                         "Why is the movie {x} considered a classic?"],
                "event": ["Summarize {x} in a few sentences.", "What caused {x}?", "Give a brief overview of {x}.",
                          "Why was {x} important?", "Explain {x} to a middle school student."]}
PAIRS = [
    ("Python", "JavaScript"), ("cats", "dogs as pets"), ("renting", "buying a home"), ("tea", "coffee"),
    ("a Roth IRA", "a traditional IRA"), ("weather", "climate"), ("viruses", "bacteria"), ("SQL", "NoSQL databases"),
    ("electric cars", "gas cars"), ("a crocodile", "an alligator"), ("affect", "effect"), ("baking", "roasting"),
    ("a latte", "a cappuccino"), ("stocks", "bonds"), ("socialism", "communism"), ("HTTP", "HTTPS"),
    ("a lake", "a pond"), ("RAM", "ROM"), ("Linux", "Windows"), ("mitosis", "meiosis"), ("a simile", "a metaphor"),
    ("yoga", "pilates"), ("a debit card", "a credit card"), ("a hurricane", "a typhoon"), ("speed", "velocity"),
    ("frogs", "toads"), ("the Baroque", "the Classical period in music"), ("a republic", "a democracy"),
    ("running", "swimming for fitness"), ("e-books", "printed books"), ("a violin", "a viola"),
    ("Java", "C++"), ("TCP", "UDP"), ("a compiler", "an interpreter"), ("git merge", "git rebase"),
    ("RAM", "disk storage"), ("a stack", "a queue"), ("git pull", "git fetch"), ("a list", "a tuple in Python"),
    ("let", "const in JavaScript"), ("weightlifting", "cardio"), ("a crow", "a raven"), ("emigrate", "immigrate"),
    ("butter", "margarine"), ("a fever", "a cold"), ("a comet", "an asteroid"), ("rugby", "American football"),
]
COMPARE_OPEN = ["What is the difference between {a} and {b}?", "{A} vs {b}: what's the difference?",
                "Compare {a} and {b} in a short table.", "How are {a} and {b} similar, and how are they different?",
                "Explain the difference between {a} and {b} in one paragraph."]
PROCON = ["working from home", "social media for teenagers", "nuclear power", "electric scooters", "homeschooling",
          "a four-day work week", "living in a big city", "online dating", "self-driving cars", "credit cards",
          "owning a dog", "studying abroad", "a vegetarian diet", "solar energy", "open-plan offices", "freelancing",
          "tiny houses", "school uniforms", "standing desks", "cloud storage", "learning Latin", "early retirement",
          "public transport", "smart home devices", "buying a used car", "intermittent fasting", "e-books",
          "remote learning", "minimum wage increases", "space tourism"]
PROCON_OPEN = ["What are the pros and cons of {x}?", "Give me two advantages and two disadvantages of {x}.",
               "Weigh the pros and cons of {x} in a short list.", "Write a balanced argument for and against {x}."]
COUNTRIES = ["Australia", "Canada", "Japan", "Brazil", "Kenya", "Norway", "Egypt", "Argentina", "Vietnam", "Peru",
             "Portugal", "Mongolia", "New Zealand", "Morocco", "Thailand", "Chile", "Ireland", "Ghana", "Finland", "Mexico"]
TRIVIA = [
    "What is the longest river in Africa?", "Who wrote Pride and Prejudice?", "Who painted the Mona Lisa?",
    "What is the tallest mountain in the world?", "How many bones are in the adult human body?",
    "What is the largest desert on Earth?", "Who was the first person to walk on the Moon?",
    "What is the chemical symbol for gold?", "How many players are on a soccer team on the field?",
    "Which country has the most people?", "Who composed the Four Seasons?", "What language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?", "How many continents are there?",
    "What is the hardest natural substance?", "Who invented the telephone?", "What is the smallest country in the world?",
    "Which animal is known as the king of the jungle?", "How many strings does a standard guitar have?",
    "When did World War II end?", "What is the largest organ of the human body?", "Who discovered penicillin?",
    "What is the speed of light?", "How long does it take Earth to orbit the Sun?", "What is the boiling point of water at sea level?",
    "Which ocean is the largest?", "Who was Cleopatra?", "Who won the first FIFA World Cup?",
    "How many rings are on the Olympic flag?", "What is the national animal of Scotland?",
    "Which instrument has 88 keys?", "Who was Ludwig van Beethoven?", "What is the main ingredient in paella?",
    "How long is a marathon?", "What does DNA stand for?", "Which gas do plants absorb from the air?",
    "What is the fastest land animal?", "How many hearts does an octopus have?", "Which bird is the largest in the world?",
    "What is the currency of Japan?", "Who wrote the Odyssey?", "In which country is Machu Picchu?",
    "How many minutes are in a day?", "Who was Marie Curie?", "What sport is played at Wimbledon?",
    "Which metal is liquid at room temperature?", "What is the tallest animal?", "Who painted The Starry Night?",
    "What is the largest country by area?", "How many teeth does an adult human have?",
    "Which band sang 'Hey Jude'?", "Who is known as the father of modern physics?", "What is a group of lions called?",
    "How deep is the Mariana Trench?", "What is the most spoken language in the world?", "Who built the Taj Mahal?",
]
TRIVIA_T = ["What is the capital of {c}?", "What language is spoken in {c}?", "What is {c} famous for?",
            "What currency does {c} use?", "Tell me three interesting facts about {c}."]
ANIMALS = ["elephants", "penguins", "dolphins", "honeybees", "owls", "kangaroos", "wolves", "sea turtles", "giraffes",
           "ants", "bats", "hummingbirds", "sloths", "chameleons", "koalas", "sharks", "camels", "frogs", "polar bears",
           "parrots", "hedgehogs", "salmon", "crows", "horses", "rabbits", "spiders", "flamingos", "beavers"]
ANIMAL_T = ["Where do {a} live?", "What do {a} eat?", "Tell me a fun fact about {a}.", "How long do {a} live?",
            "How do {a} communicate?", "Why are {a} important to the ecosystem?", "How do {a} sleep?"]
SPORTS = ["basketball", "tennis", "cricket", "volleyball", "baseball", "ice hockey", "golf", "badminton",
          "rugby", "table tennis", "water polo", "curling", "fencing", "handball"]
SPORT_T = ["Explain the basic rules of {s}.", "How is scoring done in {s}?", "How many players are on a {s} team?",
           "What equipment do I need to start playing {s}?", "What is the history of {s}?"]
MUSIC = ["the blues", "hip hop", "reggae", "classical music", "K-pop", "country music", "flamenco",
         "punk rock", "opera", "bossa nova", "electronic dance music", "gospel music"]
MUSIC_T = ["Where did {m} come from?", "What are the main features of {m}?", "Recommend five songs to get into {m}.",
           "Who are some famous {m} artists?"]
GRAMMAR_FIX = [
    "me and him goes to the store yesterday.", "She don't like apples.", "Their going to the park tomorrow.",
    "I has three cat and two dog.", "Who's book is this?", "The informations are not correct.",
    "He runned very fast in the race.", "Can you borrow me your pen?", "I am agree with you.",
    "Its a beautiful day, isnt it", "We was late because of the traffic.", "Between you and I, the plan is bad.",
    "She is more taller than her sister.", "I didn't saw nothing.", "Everyone have their own opinion.",
    "The dog wagged it's tail.", "I could of finished earlier.", "There is many reasons to stay.",
]
CASUAL = ["hey, can u send me the report asap? thx", "gonna be late, traffic is crazy", "this product is kinda meh tbh",
          "yo, meeting's moved to 3, don't forget", "can't make it tmrw, sorry!!", "pls fix the printer, it's broken again",
          "lol that presentation went way better than i thought", "need the files by friday or we're toast"]
FORMAL = ["We regret to inform you that your application has not been successful.",
          "Please be advised that the office will remain closed until further notice.",
          "I am writing to express my dissatisfaction with the service I received.",
          "Kindly ensure that all documents are submitted prior to the deadline.",
          "We would be delighted if you could attend our annual celebration.",
          "Your request has been received and is currently under review."]
WORDY = ["In my personal opinion, I think that we should probably consider the possibility of maybe leaving earlier.",
         "Due to the fact that it was raining, the game was postponed to a later date in the future.",
         "At this point in time, we are currently in the process of reviewing all of the applications.",
         "The reason why I am writing this email is because I wanted to ask you a question.",
         "It is absolutely essential and necessary that each and every one of us attends the meeting.",
         "She made the decision to go ahead and start the project in spite of the fact that it was late."]
REVIEWS = ["The battery lasts all day and the screen is gorgeous.", "Terrible service, we waited an hour for cold food.",
           "It's okay, nothing special but it does the job.", "I've never been so disappointed by a sequel.",
           "The hotel staff went out of their way to help us.", "The package arrived two weeks late and damaged.",
           "Honestly the best pizza I've had in years!", "The instructions were confusing, but the product works fine.",
           "I wouldn't buy this again, it broke after a week.", "What a lovely little café, the cakes are amazing.",
           "The movie was long, but the ending made it worth it.", "Customer support never answered my emails."]
HEADLINES = ["Local team wins championship after dramatic overtime", "Central bank raises interest rates again",
             "New smartphone features a foldable screen", "Parliament debates new climate bill",
             "Startup raises $20 million to build delivery robots", "Scientists discover new species of frog in Peru",
             "Star striker signs five-year contract", "Stock markets fall amid trade worries"]
SPAM = ["Congratulations! You have won a free cruise. Click here to claim now!",
        "Hi Sam, attached is the agenda for Thursday's meeting.",
        "URGENT: your account will be suspended unless you verify your password today.",
        "Reminder: your dentist appointment is tomorrow at 10am.",
        "Make $5000 a week from home with this one simple trick!!!"]
NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Keiko", "Liam",
         "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wei", "Zoe"]
CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Berlin", "Toronto", "Sydney", "Mumbai", "Oslo", "Cairo", "Denver", "Seoul"]
JOBS = ["nurse", "engineer", "teacher", "designer", "chef", "pilot", "lawyer", "farmer", "developer", "plumber"]
ITEMS = [("notebook", 3.5), ("pen", 1.2), ("backpack", 29.99), ("water bottle", 12.0), ("lamp", 24.5),
         ("mug", 8.0), ("headphones", 59.0), ("stapler", 6.75), ("umbrella", 15.0), ("calculator", 18.25)]
BUSINESSES = ["a bakery", "a dog-walking service", "a coffee shop", "a bike repair shop", "a podcast about history",
              "a mobile app for tracking habits", "a band that plays indie rock", "a yoga studio", "a food truck selling tacos",
              "a bookstore", "a cleaning company", "a YouTube channel about science", "a fantasy kingdom", "a pet goldfish",
              "a sailing boat", "a tech startup that makes smart water bottles", "a board game about trains", "a robot vacuum"]
BRAIN_OPEN = ["Suggest five names for {b}.", "Give me ten creative name ideas for {b}.", "Write a catchy slogan for {b}.",
              "Brainstorm marketing ideas for {b}.", "Write a short product description for {b}."]
IDEAS = ["a 10-year-old's birthday party", "a rainy weekend", "a team lunch on a budget", "a first date",
         "a science fair project", "a blog about personal finance", "a short film", "a community fundraiser",
         "a Halloween costume", "a gift for a coworker", "a family reunion", "a school newspaper article",
         "a small garden", "an anniversary dinner", "a YouTube video", "a picnic menu", "a road trip across Spain"]
IDEA_OPEN = ["Give me some ideas for {i}.", "Brainstorm five ideas for {i}.", "What are some fun ideas for {i}?",
             "I need inspiration for {i}. Any suggestions?"]
YESNO = [
    "Is a tomato a fruit?", "Can penguins fly?", "Is it safe to eat raw cookie dough?", "Do fish sleep?",
    "Can dogs eat chocolate?", "Is glass a liquid?", "Do camels store water in their humps?",
    "Is the Great Wall of China visible from space?", "Can you see the Moon during the day?", "Is zero an even number?",
    "Do bananas grow on trees?", "Is it bad to crack your knuckles?", "Can lightning strike the same place twice?",
    "Is a whale a fish?", "Do humans use only 10 percent of their brains?", "Is Python a compiled language?",
    "Can a spider be an insect?", "Is coffee bad for you?", "Is it okay to water plants at night?",
    "Do bulls hate the color red?", "Is a peanut a nut?", "Can you recycle pizza boxes?", "Is 0.999... equal to 1?",
    "Should I turn off my computer every night?", "Does cold weather give you a cold?", "Is honey safe for babies?",
    "Is a square a rectangle?", "Can plants grow without soil?", "Is HTML a programming language?",
]
YESNO_SUFFIX = [" Answer yes or no and give one reason.", " Explain briefly.", " Give a short answer with a reason.", ""]
ROLES = ["a pirate captain", "a medieval knight", "a tour guide in Rome", "a friendly customer support agent",
         "Sherlock Holmes", "a personal trainer", "a 1920s radio announcer", "a wise old wizard", "a nature documentary narrator",
         "a strict math teacher", "a cheerful kindergarten teacher", "an alien visiting Earth for the first time",
         "a sports commentator", "a museum guide", "a chef on a cooking show", "a travel agent", "a librarian"]
ROLE_TASKS = ["introduce yourself", "explain how to make a sandwich", "describe your favorite day", "give me advice about saving money",
              "welcome me to your shop", "tell me about the weather today", "explain why exercise matters",
              "describe a cup of coffee", "recommend a book", "explain what a computer is", "cheer me up after a bad day"]
ROLE_OPEN = ["Pretend you are {r} and {t}.", "You are {r}. Please {t}.", "Act as {r} and {t}.",
             "In the voice of {r}, {t}."]
MISC = ["Tell me a joke about programmers.", "Tell me a clean joke about math.", "Give me a riddle and its answer.",
        "Write a motivational quote for a Monday morning.", "What should I name my new goldfish?",
        "Write a tweet announcing that our bakery now sells gluten-free bread.", "Recommend three podcasts about history.",
        "Recommend five books about personal finance for beginners.", "What are some good movies for a family night?",
        "Write a tongue twister about frogs.", "Write a fortune cookie message.", "Create a pub quiz with five questions about geography.",
        "Make up a new holiday and describe how people celebrate it.", "Write a short toast for a friend's birthday.",
        "Give me a 20-minute workout I can do at home without equipment.", "Plan a three-day trip to Lisbon.",
        "Create a weekly study schedule for learning Spanish.", "Plan a healthy vegetarian meal plan for one day.",
        "Write a packing list for a weekend in the mountains.", "Give me a morning routine that takes 30 minutes.",
        "Create a simple chore chart for two kids.", "Write five interview questions for a barista position.",
        "Suggest a reading list for someone who loved The Hobbit.", "Write a fun fact about space for a kids' newsletter.",
        "Write a two-line rhyme to remember how many days are in each month.",
        "Create a mnemonic to remember the colors of the rainbow."]
SEQS = [[2, 4, 8, 16, 32], [3, 6, 9, 12, 15], [1, 4, 9, 16, 25], [5, 10, 20, 40], [1, 1, 2, 3, 5, 8], [100, 90, 81, 73],
        [7, 14, 21, 28], [1, 3, 6, 10, 15], [2, 6, 18, 54], [81, 27, 9, 3], [10, 13, 16, 19], [1, 8, 27, 64]]
UNITS = [("kilometers", "miles", 1, 500), ("miles", "kilometers", 1, 300), ("pounds", "kilograms", 1, 400),
         ("kilograms", "pounds", 1, 200), ("feet", "meters", 1, 1000), ("inches", "centimeters", 1, 100),
         ("liters", "gallons", 1, 100), ("cups", "milliliters", 1, 8), ("hours", "minutes", 1, 48),
         ("degrees Fahrenheit", "degrees Celsius", 0, 110), ("degrees Celsius", "degrees Fahrenheit", -20, 40),
         ("ounces", "grams", 1, 32), ("square meters", "square feet", 5, 200), ("days", "hours", 2, 30)]
THINGS_COUNT = ["apples", "marbles", "stickers", "cookies", "books", "pencils", "trading cards", "balloons"]


# -------------------------------------------------------------------------------- generators
def g_code(r: random.Random) -> str:
    k = r.randrange(9)
    lang = r.choice(LANGS)
    if k == 0:
        return f"Write a {lang} function that {r.choice(FUNC_TASKS)}."
    if k == 1:
        return r.choice(["Write a Bash script that {t}.", "How can I write a shell one-liner that {t}?"]).format(
            t=r.choice(BASH_TASKS))
    if k == 2:
        return r.choice(["Write a SQL query that {t}.", "Write an SQL statement that {t}."]).format(t=r.choice(SQL_TASKS))
    if k == 3:
        lang, snip = r.choice(FIX_SNIPPETS)
        return r.choice(["Fix this {l}: {s}", "What's wrong with this {l} code? {s}", "Find and fix the bug in this {l} snippet: {s}",
                         "Why does this {l} code fail? {s}"]).format(l=lang, s=snip)
    if k == 4:
        lang, code = r.choice(ONE_LINERS)
        return r.choice(["Explain what this {l} one-liner does: {c}", "What does this {l} code do? {c}",
                         "Explain this {l} line step by step: {c}"]).format(l=lang, c=code)
    if k == 5:
        if r.random() < 0.6:
            return r.choice(["Write a regex that matches {t}.", "Give me a regular expression for {t}."]).format(
                t=r.choice(REGEX_TARGETS))
        return f"Explain this regular expression: {r.choice(REGEXES)}"
    if k == 6:
        tl = r.choice(["Python", "JavaScript", "Java"])
        return r.choice(["Write unit tests in {l} for {t}.", "How would I unit test {t} in {l}?"]).format(
            l=tl, t=r.choice(UNIT_TEST_TARGETS))
    if k == 7:
        cl = r.choice(list(CONCEPTS))
        return r.choice(["Explain {c} in {l} with a short example.", "How do I use {c} in {l}?",
                         "Show me a simple {l} example that uses {c}.", "When should I use {c} in {l}?"]).format(
            c=r.choice(CONCEPTS[cl]), l=cl)
    a, b = r.sample(LANGS, 2)
    if r.random() < 0.3:
        return f"Translate this Python function into {a if a != 'Python' else b}: def square(n): return n * n"
    return f"I have a {a} function that {r.choice(FUNC_TASKS)}. How would I write it in {b}?"


def g_cs(r: random.Random) -> str:
    return r.choice(["Explain {t} {lvl}.", "What is {t}?", "Can you explain {t} {lvl}?",
                     "Give a simple example of {t}."]).format(t=r.choice(CS_TOPICS), lvl=r.choice(LEVELS))


def g_math(r: random.Random) -> str:
    k = r.randrange(14)
    a, b, c = r.randint(12, 999), r.randint(3, 99), r.randint(2, 60)
    if k == 0:
        return r.choice([f"What is {a} times {b}?", f"Calculate {a} + {b} * {c}.", f"What is {a * b} divided by {b}?",
                         f"Compute {a} - {b} + {c}.", f"What is {a} squared?"])
    if k == 1:
        p = r.choice([5, 10, 12.5, 15, 20, 25, 30, 40, 75])
        return r.choice([f"What is {p}% of {a}?", f"{b} is what percent of {a + b}?",
                         f"If a price goes up by {p}% from ${a}, what is the new price?",
                         f"A jacket costs ${a} and is {p}% off. What is the sale price?"])
    if k == 2:
        f, t, lo, hi = r.choice(UNITS)
        return r.choice(["Convert {x} {f} to {t}.", "How many {t} are in {x} {f}?", "What is {x} {f} in {t}?"]).format(
            x=r.randint(lo, hi), f=f, t=t)
    if k == 3:
        x = r.randint(-9, 15)
        m, q = r.randint(2, 9), r.randint(1, 30)
        return r.choice([f"Solve for x: {m}x + {q} = {m * x + q}", f"Solve {m}x - {q} = {m * x - q} and show your steps.",
                         f"If {m}x + {q} = {m * x + q}, what is x?"])
    if k == 4:
        s = r.choice(SEQS)
        return r.choice(["What is the next number in the sequence {s}?", "Find the pattern and the next term: {s}, ...",
                         "Explain the rule behind this sequence: {s}"]).format(s=", ".join(map(str, s)))
    if k == 5:
        n1, n2 = r.sample(NAMES, 2)
        t = r.choice(THINGS_COUNT)
        return r.choice([f"{n1} has {a} {t} and gives {b} to {n2}. How many {t} does {n1} have left?",
                         f"{n1} buys {c} packs of {t} with {b} in each pack. How many {t} is that in total?",
                         f"{n1} shares {c * 6} {t} equally among 6 friends. How many does each friend get?"])
    if k == 6:
        d, h = r.randint(60, 900), r.choice([1.5, 2, 3, 4, 5, 2.5])
        return r.choice([f"A train travels {d} km in {h} hours. What is its average speed?",
                         f"A car drives at {c + 40} km/h for {h} hours. How far does it go?",
                         f"If I walk at 5 km/h, how long will it take me to walk {r.randint(3, 25)} km?"])
    if k == 7:
        w, h = r.randint(2, 30), r.randint(2, 30)
        return r.choice([f"What is the area of a rectangle that is {w} m by {h} m?", f"What is the perimeter of a square with sides of {w} cm?",
                         f"What is the area of a circle with a radius of {w} cm?", f"A triangle has a base of {w} cm and a height of {h} cm. What is its area?",
                         f"What is the volume of a box that measures {w} cm by {h} cm by {c} cm?"])
    if k == 8:
        x, y = r.randint(2, 12) * r.randint(2, 9), r.randint(2, 12)
        return r.choice([f"Simplify the fraction {x}/{x * y}.", f"What is 3/{y} + 1/{y * 2}?", f"Convert {x}/{y * 4} to a decimal.",
                         f"What is the square root of {y * y}?", f"What is {y} to the power of 3?"])
    if k == 9:
        item, price = r.choice(ITEMS)
        return f"If one {item} costs ${price:.2f}, how much do {c} of them cost, and how much change do I get from ${c * price // 1 + 20:.0f}?"
    if k == 10:
        return r.choice([f"Round {a}.{r.randint(10, 99)} to the nearest ten.", f"Is {a} divisible by {r.choice([3, 4, 6, 9, 11])}? Explain how you know.",
                         f"What is the average of {a}, {b} and {c}?", f"Write {a * 100 + b} in Roman numerals.",
                         f"Estimate {a} * {b} without a calculator, then give the exact answer."])
    if k == 11:
        rate, years, amt = r.choice([2, 3, 4, 5, 6]), r.randint(2, 10), r.choice([500, 1000, 2500, 5000])
        return r.choice([f"How much simple interest does ${amt} earn at {rate}% per year over {years} years?",
                         f"If I save ${b} a week, how much will I have after {c} weeks?",
                         f"A recipe needs {r.randint(2, 5)} cups of flour for {r.choice([4, 6, 8])} people. How much do I need for {r.choice([10, 12, 3])} people?"])
    if k == 12:
        return r.choice([f"A bag has {b % 10 + 2} red and {c % 10 + 3} blue marbles. What is the probability of drawing a red one?",
                         "If I roll two dice, what is the probability that the sum is 7?",
                         f"What are the mean, median and mode of {', '.join(str(r.randint(1, 20)) for _ in range(6))}?",
                         f"How many different ways can {r.randint(3, 6)} people stand in a line?"])
    return r.choice([f"A meeting starts at {r.randint(8, 11)}:{r.choice(['00', '15', '30', '45'])} and lasts {c + 30} minutes. When does it end?",
                     f"How many seconds are in {r.randint(2, 9)} hours?", f"How many days are there between March 3 and May {r.randint(1, 28)}?",
                     f"If today is {r.choice(['Monday', 'Wednesday', 'Friday', 'Sunday'])}, what day will it be in {a} days?"])


def g_translate(r: random.Random) -> str:
    if r.random() < 0.25:
        lang, s = r.choice(FOREIGN)
        return r.choice(["Translate this {l} sentence into English: {s}", "What does '{s}' mean in English?",
                         "Translate '{s}' from {l} to English and explain the grammar."]).format(l=lang, s=s)
    s, lang = r.choice(SENTENCES_EN), r.choice(TARGET_LANGS)
    l2 = r.choice([x for x in TARGET_LANGS if x != lang])
    return r.choice(['Translate "{s}" into {l}.', 'How do you say "{s}" in {l}?',
                     'Translate "{s}" into {l} and {m}.', 'Translate into {l}, and keep it informal: "{s}"']).format(s=s, l=lang, m=l2)


def g_list(r):
    return r.choice(LIST_OPEN).format(x=r.choice(LIST_THINGS))


def g_write(r):
    if r.random() < 0.6:
        return "Write " + r.choice(MSG_KINDS).format(p=(e := r.choice(EMAILS))[0], r=r.choice(e[1]))
    return r.choice(["Write {n}.", "Help me write {n}.", "Draft {n}.", "Can you write {n}? Keep it short."]).format(n=r.choice(NOTES))


def g_cook(r):
    k = r.randrange(3)
    if k == 0:
        return r.choice(COOK_OPEN).format(d=r.choice(DISHES))
    if k == 1:
        ing = r.sample(INGREDIENTS, 3)
        return r.choice([f"What can I cook with {ing[0]}, {ing[1]} and {ing[2]}?",
                         f"I have {ing[0]}, {ing[1]} and {ing[2]} in the fridge. Suggest a quick dinner.",
                         f"Give me a 20-minute recipe using {ing[0]} and {ing[1]}."])
    return r.choice(COOK_Q)


def g_howto(r):
    if r.random() < 0.6:
        return r.choice(HOWTO_OPEN).format(t=r.choice(HOWTO_TASKS))
    return r.choice(TIP_OPEN).format(g=r.choice(TIP_GOALS))


def g_explain(r):
    k = r.randrange(3)
    if k == 0:
        return r.choice(["Explain {t} {l}.", "Can you explain {t} {l}?", "Help me understand {t}. Explain it {l}."]).format(
            t=r.choice(SCIENCE_TOPICS), l=r.choice(LEVELS))
    if k == 1:
        return r.choice(["What does '{w}' mean?", "Define {w} and give an example.", "What is {w}? Explain {l}.",
                         "Use the word '{w}' in three example sentences."]).format(w=r.choice(WORDS_TO_DEFINE), l=r.choice(LEVELS))
    nouns = [t for t in SCIENCE_TOPICS if t.split()[0] not in ("how", "what", "why")]
    return r.choice(["Why should I care about {t}? Answer briefly.", "What are common myths about {t}?",
                     "Give me three surprising facts about {t}.", "Write a short quiz with three questions about {t}."]).format(
        t=r.choice(nouns))


def g_creative(r):
    k = r.randrange(4)
    if k <= 1:
        return r.choice(CREATIVE_OPEN).format(s=r.choice(CREATIVE_SUBJECTS))
    if k == 2:
        return r.choice(["Write a short story about {c} who {s}.", "Write a 100-word story about {c} who {s}.",
                         "Tell me a bedtime story about {c} who {s}."]).format(c=r.choice(CHARACTERS), s=r.choice(SITUATIONS))
    a, b = r.choice(DIALOGUE_PAIRS)
    who = a if b is None else f"{a} and {b}"
    return f"Write a short dialogue between {who} about {r.choice(DIALOGUE_TOPICS)}."


def g_summary(r):
    kind = r.choice(["book", "book", "film", "event", "event"])
    x = r.choice({"book": BOOKS, "film": FILMS, "event": EVENTS}[kind])
    return r.choice(SUMMARY_OPEN[kind]).format(x=x)


def g_compare(r):
    a, b = r.choice(PAIRS)
    if r.random() < 0.2:
        return r.choice(["Explain {a} vs {b} to a beginner.", "Give one example that shows the difference between {a} and {b}."]).format(a=a, b=b)
    return r.choice(COMPARE_OPEN).format(a=a, b=b, A=a[0].upper() + a[1:])


def g_procon(r):
    return r.choice(PROCON_OPEN).format(x=r.choice(PROCON))


def g_trivia(r):
    k = r.randrange(6)
    if k <= 1:
        return r.choice(TRIVIA)
    if k == 2:
        return r.choice(TRIVIA_T).format(c=r.choice(COUNTRIES))
    if k == 3:
        return r.choice(ANIMAL_T).format(a=r.choice(ANIMALS))
    if k == 4:
        return r.choice(SPORT_T).format(s=r.choice(SPORTS))
    return r.choice(MUSIC_T + ["Who wrote {b}?", "When was {b} published?"]).format(m=r.choice(MUSIC), b=r.choice(BOOKS))


def g_rewrite(r):
    k = r.randrange(5)
    if k == 0:
        return r.choice(["Correct the grammar in this sentence: {s}", "Fix the mistakes: {s}", "Is this sentence correct? {s}"]).format(
            s=r.choice(GRAMMAR_FIX))
    if k == 1:
        return r.choice(["Make this message more formal: \"{s}\"", "Rewrite this professionally: {s}"]).format(s=r.choice(CASUAL))
    if k == 2:
        return r.choice(["Make this sound more casual and friendly: \"{s}\"", "Rewrite this in plain English: {s}"]).format(
            s=r.choice(FORMAL))
    if k == 3:
        return r.choice(["Make this sentence more concise: {s}", "Shorten this without losing the meaning: {s}"]).format(s=r.choice(WORDY))
    s = r.choice(SENTENCES_EN + REVIEWS)
    return r.choice(["Paraphrase this sentence: {s}", "Rewrite this sentence in the passive voice: {s}",
                     "Rewrite this so it sounds more enthusiastic: {s}", "Turn this into a question: {s}"]).format(s=s)


def g_classify(r):
    k = r.randrange(4)
    if k <= 1:
        return r.choice(["What is the sentiment of this review: \"{s}\"", "Is this review positive, negative or neutral? {s}",
                         "Classify the sentiment of this sentence as positive, negative, or neutral: {s}",
                         "Rate the sentiment of this review from 1 to 5: \"{s}\""]).format(s=r.choice(REVIEWS))
    if k == 2:
        return f"Which category does this headline belong to: sports, politics, technology, business or science? \"{r.choice(HEADLINES)}\""
    return r.choice(["Is this message spam or not? \"{s}\"", "Classify this email as spam or not spam: {s}"]).format(s=r.choice(SPAM))


def g_data(r):
    ppl = r.sample(NAMES, r.randint(2, 4))
    rows = [f"{p}, {r.randint(19, 70)}, {r.choice(CITIES)}" for p in ppl]
    k = r.randrange(5)
    if k == 0:
        return f"Convert this to JSON: name {ppl[0]}, age {r.randint(19, 70)}, city {r.choice(CITIES)}, job {r.choice(JOBS)}"
    if k == 1:
        return "Format this data as a markdown table with columns name, age, city: " + "; ".join(rows)
    if k == 2:
        return "Turn this into CSV with a header row: " + "; ".join(rows)
    if k == 3:
        its = r.sample(ITEMS, 3)
        return "Make a JSON list of these products with name and price: " + ", ".join(f"{i} ${p}" for i, p in its)
    return r.choice(["Write a JSON object describing a {t} with a few sensible fields.",
                     "Design a simple JSON schema for a {t}.", "Create a CSV header and two example rows for a {t}."]).format(
        t=r.choice(["book", "movie", "recipe", "user profile", "weather report", "library loan", "flight booking", "to-do item"]))


def g_brainstorm(r):
    if r.random() < 0.5:
        return r.choice(BRAIN_OPEN).format(b=r.choice(BUSINESSES))
    return r.choice(IDEA_OPEN).format(i=r.choice(IDEAS))


def g_yesno(r):
    return r.choice(YESNO) + r.choice(YESNO_SUFFIX)


def g_role(r):
    return r.choice(ROLE_OPEN).format(r=r.choice(ROLES), t=r.choice(ROLE_TASKS))


def g_misc(r):
    return r.choice(MISC)


GENERATORS = [  # (generator, weight)
    (g_code, 14), (g_cs, 4), (g_math, 12), (g_translate, 6), (g_list, 5), (g_write, 6), (g_cook, 5), (g_howto, 7),
    (g_explain, 8), (g_creative, 8), (g_summary, 5), (g_compare, 4), (g_procon, 3), (g_trivia, 7), (g_rewrite, 5),
    (g_classify, 3), (g_data, 3), (g_brainstorm, 4), (g_yesno, 2), (g_role, 3), (g_misc, 1),
]


def norm(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip().lower()


def read_excluded() -> set[str]:
    out = set()
    for path in EXCLUDE_FILES:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.add(norm(line))
    return out


def generate(n: int, seed: int = SEED) -> tuple[list[str], int]:
    r = random.Random(seed)
    excluded = read_excluded()
    gens, weights = zip(*GENERATORS)
    seen, out, dropped = set(), [], 0
    for _ in range(n * 200):
        if len(out) >= n:
            break
        p = re.sub(r"\s+", " ", r.choices(gens, weights)[0](r)).strip()
        key = norm(p)
        if key in seen:
            continue
        seen.add(key)
        if key in excluded or any(b in key for b in BANNED):
            dropped += 1
            continue
        out.append(p)
    r.shuffle(out)
    assert not any(norm(p) in excluded for p in out)
    assert all(p and not p.startswith("#") and "\n" not in p for p in out)
    return out, dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "configs/train/prompts_train_large.txt"))
    ap.add_argument("--n", type=int, default=4000)
    args = ap.parse_args()
    if args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    prompts, dropped = generate(args.n)
    Path(args.out).write_text("\n".join(prompts) + "\n", encoding="utf-8")
    print(f"wrote {len(prompts)} prompts to {args.out} ({dropped} dropped: held-out or banned subject)")
    if len(prompts) < args.n:
        print(f"warning: only {len(prompts)} distinct prompts could be generated (asked for {args.n})")
    for p in random.Random(SEED + 1).sample(prompts, min(8, len(prompts))):
        print("  " + p)


if __name__ == "__main__":
    main()
