BEGIN TRANSACTION;
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO "meta" VALUES('format','1');
CREATE TABLE records (
    kind TEXT NOT NULL,
    job  TEXT NOT NULL,
    key  TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (kind, job, key)
) WITHOUT ROWID;
INSERT INTO "records" VALUES('ack','job1','000000000001.000000','{"attempt":0}');
INSERT INTO "records" VALUES('consumed','job1','000000000000','[{"group_id":"g0","source":"math","num_trajectories":2,"v_train":0,"mini_batch_index":0,"step":0,"version_start":0,"version_end":0,"version_weighted":0.0}]');
INSERT INTO "records" VALUES('fetched','job1','000000000001.000000','{"attempt":0}');
INSERT INTO "records" VALUES('fetched','job1','000000000001.000001','{"attempt":0}');
INSERT INTO "records" VALUES('group','job1','g2','{"unit_id":"u2","status":"lost"}');
INSERT INTO "records" VALUES('group','job1','g3','{"unit_id":"u2","status":"expired"}');
INSERT INTO "records" VALUES('group','job1','late','{"unit_id":"u-late","status":"expired"}');
INSERT INTO "records" VALUES('job','job1','meta','{"spec":{"name":"job1","group_size":2,"quotas":{"math":2},"mini_batches_per_step":2,"policy":"constraint_preserving","world_size":2,"micro_batch_tokens":null,"micro_batch_size":2,"bounds":{},"max_staleness":0,"total_steps":null,"columns":null,"lookahead":64,"window":1,"user_fields":{}},"state":"running","next_n":2,"attempts":{"0":0,"1":0,"2":0},"quota_changes":[[0,{"math":2}]]}');
INSERT INTO "records" VALUES('lost','job1','g2','{"group_id":"g2","source":"math","reason":"node n2 lost","unit_id":"u2","node_id":"n2","at":1796133639.9883988}');
INSERT INTO "records" VALUES('lost','job1','g3','{"group_id":"g3","source":"math","reason":"expired","unit_id":"u2","node_id":"n2","at":1796133639.982369}');
INSERT INTO "records" VALUES('lost','job1','late','{"group_id":"late","source":"math","reason":"expired","unit_id":"u-late","node_id":"n0","at":1796133639.9495387}');
INSERT INTO "records" VALUES('mb','job1','000000000000','{"n":0,"step":0,"k":0,"attempt":0,"group_ids":["g0"],"counts":{"math":1},"admitted_at":1796133639.8260174,"status":"consumed"}');
INSERT INTO "records" VALUES('mb','job1','000000000001','{"n":1,"step":0,"k":1,"attempt":0,"group_ids":["g1"],"counts":{"math":1},"admitted_at":1796133639.9536407,"status":"planned","layout":[[[["g1",1]]],[[["g1",0]]]]}');
INSERT INTO "records" VALUES('node','','n0','{"node_id":"n0","endpoint":"grpc://127.0.0.1:1","host":"","registered_at":1796133639.782469,"lost":false,"lost_reason":"","key_hash":""}');
INSERT INTO "records" VALUES('node','','n1','{"node_id":"n1","endpoint":"grpc://127.0.0.1:1","host":"","registered_at":1796133639.7872303,"lost":false,"lost_reason":"","key_hash":""}');
INSERT INTO "records" VALUES('node','','n2','{"node_id":"n2","endpoint":"grpc://127.0.0.1:1","host":"","registered_at":1796133639.7912414,"lost":true,"lost_reason":"gone","key_hash":""}');
INSERT INTO "records" VALUES('request','job1','req-1','1');
INSERT INTO "records" VALUES('started','job1','s0','"math"');
INSERT INTO "records" VALUES('started','job1','s1','"math"');
INSERT INTO "records" VALUES('supply','job1','math','{"started":3,"dropped":0,"finished":5}');
INSERT INTO "records" VALUES('units','job1','000000000000','[{"unit_id":"u0","job":"job1","node_id":"n0","endpoint":"grpc://127.0.0.1:1","num_rows":2,"num_bytes":200,"schema_version":1,"groups":[{"group_id":"g0","source":"math","row_start":0,"num_trajectories":2,"trajectory_tokens":[10,11],"version_start":0,"version_end":0,"version_weighted":0.0,"finished_at":0.0,"media_hashes":[]}]}]');
INSERT INTO "records" VALUES('units','job1','000000000001','[{"unit_id":"u-late","job":"job1","node_id":"n0","endpoint":"grpc://127.0.0.1:1","num_rows":2,"num_bytes":200,"schema_version":1,"groups":[{"group_id":"late","source":"math","row_start":0,"num_trajectories":2,"trajectory_tokens":[10,11],"version_start":0,"version_end":0,"version_weighted":0.0,"finished_at":0.0,"media_hashes":[]}]}]');
INSERT INTO "records" VALUES('units','job1','000000000002','[{"unit_id":"u1","job":"job1","node_id":"n1","endpoint":"grpc://127.0.0.1:1","num_rows":2,"num_bytes":200,"schema_version":1,"groups":[{"group_id":"g1","source":"math","row_start":0,"num_trajectories":2,"trajectory_tokens":[10,11],"version_start":1,"version_end":1,"version_weighted":1.0,"finished_at":0.0,"media_hashes":[]}]}]');
INSERT INTO "records" VALUES('units','job1','000000000003','[{"unit_id":"u2","job":"job1","node_id":"n2","endpoint":"grpc://127.0.0.1:1","num_rows":4,"num_bytes":400,"schema_version":1,"groups":[{"group_id":"g2","source":"math","row_start":0,"num_trajectories":2,"trajectory_tokens":[10,11],"version_start":2,"version_end":2,"version_weighted":2.0,"finished_at":0.0,"media_hashes":[]},{"group_id":"g3","source":"math","row_start":2,"num_trajectories":2,"trajectory_tokens":[10,11],"version_start":2,"version_end":2,"version_weighted":2.0,"finished_at":0.0,"media_hashes":[]}]}]');
INSERT INTO "records" VALUES('version','job1','0','1');
COMMIT;
