import random
from examples.search_r1.env import SYSTEM_PROMPT, clip, SearchR1Env
from agentrl.envs.formats import HermesFormat, ToolCall
C = "bcdfghjklmnprstvwz"; V = "aeiou"
def name(rng):
    s = "".join(rng.choice(C) + rng.choice(V) + (rng.choice("nrlst") if rng.random() < 0.3 else "") for _ in range(rng.choice([2, 2, 3])))
    return s.capitalize()
fmt = HermesFormat()
def call(q): return fmt.render_calls([ToolCall("search", {"query": q})])
def res(docs): return "\n".join(f"[{i+1}] {clip(d, SearchR1Env.snippet_chars)}" for i, d in enumerate(docs))
def chat(rng):
    k = rng.choice(["capital", "neighbour_capital", "country_of_capital", "population_by_capital"])
    x, y, z, w, c = (name(rng) for _ in range(5)); pop = str(rng.randint(1000, 99999999))
    m = [{"role": "system", "content": SYSTEM_PROMPT}]
    def turn(q, docs): m.extend([{"role": "assistant", "content": call(q)}, {"role": "tool", "name": "search", "content": res(docs)}])
    if k == "capital":
        m.append({"role": "user", "content": f"What is the capital of {x}?"})
        turn(f"capital of {x}", [f"The capital of {x} is {c}.", rng.choice([f"The population of {x} is {pop}.", f"{w} borders {x}."])]); ans = c
    elif k == "country_of_capital":
        m.append({"role": "user", "content": f"Which country has the capital {c}?"})
        turn(f"capital {c}", [f"The capital of {x} is {c}.", f"The capital of {w} is {name(rng)}."]); ans = x
    elif k == "population_by_capital":
        m.append({"role": "user", "content": f"What is the population of the country whose capital is {c}?"})
        turn(f"capital {c}", [f"The capital of {x} is {c}.", f"The capital of {w} is {name(rng)}."])
        turn(f"population of {x}", [f"The population of {x} is {pop}.", f"The capital of {x} is {c}."]); ans = pop
    else:
        m.append({"role": "user", "content": f"What is the capital of the country that borders {x} and {y}?"})
        nb = [x, y, w]; rng.shuffle(nb)
        turn(f"borders {x} and {y}", [f"{z} borders {', '.join(nb)}.", f"{x} borders {z}, {name(rng)}."])
        turn(f"capital of {z}", [f"The capital of {z} is {c}.", f"{w} borders {z}."]); ans = c
    m.append({"role": "assistant", "content": f"<answer>{ans}</answer>"})
    return m
