"""python summarize.py device_logs: one block per probe log (warm-up pass@k rows; GRPO held-out / GRPO-pool /
made-up-pool greedy exact match every 10 steps)."""
import json, sys, glob
d=sys.argv[1]
for f in sorted(glob.glob(f'{d}/*.jsonl')):
    name=f.split('/')[-1].removesuffix('.jsonl')
    rows=[json.loads(l) for l in open(f)]
    probes=[r for r in rows if any('/' in k for k in r)]
    evals=[r for r in rows if 'eval' in r]
    steps=[r for r in rows if 'groups' in r]
    if probes:
        print('==', name)
        for r in probes:
            s=r.get('warmup_step')
            def g(p): 
                x=r.get(f'{p}/greedy',{}); a=r.get(f'{p}/T0.7',{}); b=r.get(f'{p}/T1.0',{})
                return f"{p[:4]} g{x.get('em',0):.2f} T.7 p1 {a.get('pass1',0):.2f} p16 {a.get('pass16',0):.2f} | T1 p1 {b.get('pass1',0):.2f} p16 {b.get('pass16',0):.2f}"
            print(f"  step {s} loss {r['warmup_loss']:.2f} chk {r['warmup_check']:.2f} | "+' || '.join(g(p) for p in ['heldout','train','synthetic']))
    if evals:
        print('==', name, 'evals (held/train/syn):', ' '.join(f"{e['step']}:{e['eval']['em']:.2f}/{e['train_pool']['em']:.2f}/{e['synthetic_pool']['em']:.2f}" for e in evals), 't_end', rows[-1]['t'])
        if steps:
            n=len(steps); q=max(1,n//10)
            print('   reward first/last tenth', round(sum(s['reward'] for s in steps[:q])/q,3), round(sum(s['reward'] for s in steps[-q:])/q,3), 'kept', round(sum(s['groups_kept'] for s in steps)/n,2),'/',steps[0]['groups'], 'searches', steps[0]['searches'], steps[-1]['searches'], 'entropy', round(sum(s.get('entropy',0) for s in steps[-q:])/q,3))
