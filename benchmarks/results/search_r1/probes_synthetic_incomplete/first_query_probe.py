import sys, random, torch
sys.path[:0] = ["/work/main"]
from transformers import AutoModelForCausalLM, AutoTokenizer
from agentrl.envs.render import ChatRenderer
from examples.search_r1.synthetic import synthetic_question
from examples.search_r1.questions import make_questions
from examples.search_r1.env import SearchR1Env
torch.set_num_threads(1)
d = sys.argv[1]; tok = AutoTokenizer.from_pretrained(d); m = AutoModelForCausalLM.from_pretrained(d).eval(); r = ChatRenderer(tok)
rng = random.Random(11)
kw = dict(kinds=["capital", "neighbour_capital"], holdout="question", warmup_share=0.75)
qs = [synthetic_question("capital", rng, str(i)) for i in range(8)] + make_questions(8, split="heldout", **kw)
for q in qs:
    env = SearchR1Env(); msgs = env.reset(q)
    ids = r.render(msgs, SearchR1Env.tool_schemas(), add_generation_prompt=True).ids
    out = m.generate(torch.tensor([ids]), max_new_tokens=50, do_sample=False)
    print(q["question"], "->", tok.decode(out[0][len(ids):], skip_special_tokens=True)[-45:])
