import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.HexFormat;

import org.apache.kafka.clients.producer.internals.BuiltInPartitioner;

/**
 * The partition the Java producer (KafkaProducer, and so Kafka Connect and Debezium)
 * chooses for a keyed record: BuiltInPartitioner.partitionForKey, i.e.
 * toPositive(murmur2(key)) % partitions.
 *
 * Run with Java's single-file source launch and kafka-clients on the classpath:
 *   java -cp CLASSPATH JavaPartition.java 3 7 12 < keys
 * stdin: one key per line, hex of its bytes (an empty line is the empty key);
 * stdout: per key, one line with its partition for each count given, space-separated.
 */
public class JavaPartition {
    public static void main(String[] args) throws Exception {
        int[] counts = new int[args.length];
        for (int i = 0; i < args.length; i++) {
            counts[i] = Integer.parseInt(args[i]);
        }
        HexFormat hex = HexFormat.of();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.US_ASCII));
        StringBuilder out = new StringBuilder();
        String line;
        while ((line = in.readLine()) != null) {
            byte[] key = hex.parseHex(line.trim());
            for (int i = 0; i < counts.length; i++) {
                if (i > 0) {
                    out.append(' ');
                }
                out.append(BuiltInPartitioner.partitionForKey(key, counts[i]));
            }
            out.append('\n');
        }
        System.out.print(out);
    }
}
