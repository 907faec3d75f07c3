import json,sys,os
a_dir,b_dir=sys.argv[1],sys.argv[2]
for f in sorted(os.listdir(a_dir+"/predictions")):
    def load(p):
        return {j["question_id"]:j for j in map(json.loads,open(p))}
    a=load(a_dir+"/predictions/"+f); b=load(b_dir+"/predictions/"+f)
    qs=sorted(set(a)&set(b)); same=0; scores=0; diffs=[]
    for q in qs:
        ea=[(e["id"],e["session"],e["turns"]) for e in a[q]["evidence"]]
        eb=[(e["id"],e["session"],e["turns"]) for e in b[q]["evidence"]]
        if ea==eb:
            same+=1
            if all(abs(x["score"]-y["score"])<5e-6 for x,y in zip(a[q]["evidence"],b[q]["evidence"])): scores+=1
        else: diffs.append(q)
    ra=sum(a[q]["recall"] or 0 for q in qs)/max(1,len(qs)); rb=sum(b[q]["recall"] or 0 for q in qs)/max(1,len(qs))
    print(f"{f}: {len(qs)} common, {same} identical lists ({scores} with scores within 5e-6), recall {ra:.4f} vs {rb:.4f}; differing: {diffs[:8]}")
